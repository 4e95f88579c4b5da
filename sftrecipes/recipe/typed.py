"""The typed Recipe: a recipe's own sections (model, data, launch, run), the TRL and peft keys it sets, where each
key came from, and the values a run reads (a TRL key's default where unset); built by load.py, read everywhere."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sftrecipes.recipe.schema import DataOptions, LaunchOptions, ModelOptions, RunOptions, all_options


@dataclass
class Recipe:
    model: ModelOptions
    data: DataOptions
    launch: LaunchOptions
    run: RunOptions
    trl: dict[str, Any]  # SFTConfig keys the recipe sets explicitly; everything else keeps TRL's default
    peft: dict[str, Any] = field(default_factory=dict)  # LoraConfig keys the recipe sets; the rest keep peft's default
    explicit: set[str] = field(default_factory=set)  # every key the user set (flat names, launch.<x>)
    sources: list[str] = field(default_factory=list)  # recipe files, base first
    renamed: dict[str, str] = field(default_factory=dict)  # alias used -> canonical key
    ignored: dict[str, str] = field(default_factory=dict)  # key a base set for another method -> why it is not used

    @property
    def method(self) -> str:
        """What the run trains (schema.METHODS): sft, dpo or kto."""
        return self.run.method

    def trl_value(self, name: str) -> Any:
        """The value the method's TRL config (SFTConfig, DPOConfig, KTOConfig) will see: the recipe's, or its default."""
        if name in self.trl:
            return self.trl[name]
        return all_options(self.method)[name].default

    @property
    def gradient_checkpointing(self) -> bool:
        """transformers 5 spells it activation_checkpointing; gradient_checkpointing is its deprecated alias."""
        if self.trl.get("activation_checkpointing") is not None:
            return bool(self.trl["activation_checkpointing"])
        return bool(self.trl_value("gradient_checkpointing"))

    @property
    def checkpointing_kwargs(self) -> dict[str, Any]:
        """Its kwargs under either spelling (activation_checkpointing_kwargs wins a key both set), with the recipe's
        use_reentrant when checkpointing is on."""
        kw = {**(self.trl.get("gradient_checkpointing_kwargs") or {}), **(self.trl.get("activation_checkpointing_kwargs") or {})}
        if self.gradient_checkpointing:
            kw["use_reentrant"] = self.model.use_reentrant
        return kw

    def as_dict(self) -> dict[str, Any]:
        """Flat view of the explicit settings (used to compare a YAML recipe with a command line)."""
        out: dict[str, Any] = {}
        for key in sorted(self.explicit):
            section, _, name = key.rpartition(".")
            if section:
                out[key] = getattr(getattr(self, section), name)
            elif name in self.trl:
                out[key] = self.trl[name]
            elif name in self.peft:
                out[key] = self.peft[name]
            else:
                owner = all_options(self.method)[name].owner
                out[key] = getattr(getattr(self, owner), name)
        return out
