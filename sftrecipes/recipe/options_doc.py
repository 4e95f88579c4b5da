"""Option documentation: the `--help` text and docs/generated/options.md, both rendered from the schema."""

from __future__ import annotations

from sftrecipes.recipe.schema import ALIASES, CONFIGS, METHODS, NULL_IS_A_VALUE, all_options
from sftrecipes.recipe.snapshots import Option

GROUP_TITLES = {"model": "Model, LoRA, quantization", "peft": "peft `LoraConfig` (LoRA only: with use_peft_lora; defaults as peft sets them)",
                "data": "Data", "run": "Run", "launch": "Launch (`launch:` section)",
                "trl": "TRL `SFTConfig`, `DPOConfig`, `KTOConfig` / transformers `TrainingArguments` (defaults as TRL sets them)"}


def per_method(o: Option) -> str:
    """How the config classes of other methods define a TRL key differently (kind, default, choices), or ''."""
    notes = []
    for method in METHODS[1:]:
        other = all_options(method).get(o.name)
        if o.owner == "trl" and other is not None and (o.methods is None or method in o.methods) and \
                (other.kind, other.default, other.choices) != (o.kind, o.default, o.choices):
            choices = f", one of {', '.join(map(str, other.choices))}" if other.choices else ""
            notes.append(f"{CONFIGS[method]} (method {method}): {other.kind}, default {other.default!r}{choices}")
    return f" {'; '.join(notes)}." if notes else ""


def grouped_options() -> list[tuple[str, list[Option]]]:
    """(title, options) per owner, in the order --help and docs/generated/options.md show them."""
    groups: dict[str, list[Option]] = {}
    for o in all_options().values():
        groups.setdefault(o.owner, []).append(o)
    return [(GROUP_TITLES[owner], groups.get(owner, [])) for owner in GROUP_TITLES]


def null_rule(code: str = "") -> str:
    """What null does, in one sentence (`code`: the markdown quote for keys and values)."""
    c = code
    kept = "; ".join(f"{c}{k}{c} ({why})" for k, why in NULL_IS_A_VALUE.items())
    return (f"{c}KEY: null{c} ({c}--KEY null{c}) unsets a key: it takes its default, as if never set, whatever a base "
            f"recipe set; except where null is a value of the key's own: {kept}.")


def help_text() -> str:
    lines = ["usage: python train.py RECIPE.yaml [--key value ...]", "",
             "Every key below is a YAML key and a --flag. Launch keys go under `launch:` (flag --launch.KEY).",
             null_rule(), ""]
    for title, options in grouped_options():
        lines += [f"{title.replace('`', '')}:"] + [f"  --{o.name}  {o.describe()}{per_method(o)}" for o in options] + [""]
    lines.append("Aliases: " + ", ".join(f"{a} -> {c}" for a, c in ALIASES.items()))
    return "\n".join(lines)


def options_markdown() -> str:
    """docs/generated/options.md: the option table, generated from the schema (tests fail when the file is stale)."""
    out = ["# Recipe options", "",
           "Generated from `sftrecipes/recipe/schema.py` and TRL's `SFTConfig`, `DPOConfig` and `KTOConfig` by `make docs`; do not "
           "edit by hand. A key marked (method ... only) belongs to those methods' config classes.",
           "Every key is a YAML key and a `--flag`; launch keys live under `launch:` (flag `--launch.KEY`).",
           null_rule("`"), ""]
    for title, options in grouped_options():
        out += [f"## {title}", "", "| key | type | default | help |", "|---|---|---|---|"]
        for o in options:
            choices = f" One of: {', '.join(f'`{c}`' for c in o.choices)}." if o.choices else ""
            help_ = (o.scope + o.help + choices + per_method(o)).replace("|", "\\|")
            kind = o.kind.replace("|", "\\|")
            out.append(f"| `{o.name}` | {kind} | `{o.default!r}` | {help_} |")
        out.append("")
    out += ["## Aliases", "", "Accepted and mapped (the run logs the mapping):", ""]
    out += [f"- `{a}` → `{c}`" for a, c in ALIASES.items()]
    return "\n".join(out) + "\n"
