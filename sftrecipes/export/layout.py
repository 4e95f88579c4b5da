"""The tensors a config's model holds and the layout save_pretrained stores them in (StoredLayout), and a source in the
held layout presented in the stored one (HubFormat)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import AutoConfig
from transformers.core_model_loading import revert_weight_conversion

from sftrecipes.core.errors import RecipeError
from sftrecipes.model.meta import build


def _meta_model(config_dir: Path):
    """The model of a config.json, built on the meta device (no memory, no data). Inside a ZeRO-3 run (merge_in_run,
    rank 0 alone) from_config would build under deepspeed.zero.Init, a collective the other ranks never join: a hang;
    meta.build switches ZeRO-3 off for the build."""
    return build(AutoConfig.from_pretrained(config_dir))


def tied_copies(model) -> dict[str, str]:
    """tied copy -> the tensor it shares (e.g. lm_head.weight -> model.embed_tokens.weight); save_pretrained writes
    only the second."""
    return dict(getattr(model, "all_tied_weights_keys", None) or {})


def _cut(t: torch.Tensor, piece: tuple | None) -> torch.Tensor:
    """The stored piece of a tensor in the layout the model holds (see stored_layout): t[expert][rows]."""
    if piece is None:
        return t
    _, expert, rows = piece
    t = t[expert] if expert is not None else t
    return t[rows] if rows is not None else t


class StoredLayout:
    """How a model folder stores the tensors the model holds. transformers 5 converts some checkpoints as it loads
    them and reverts that as it saves (mixture-of-experts experts: one tensor per expert and projection on disk, fused
    3-D parameters in memory; renamed modules, e.g. Mixtral's block_sparse_moe -> mlp). transformers 5.24 loads either
    layout, but the hub's tools (vLLM, transformers 4, converters) read the stored one, so exports write that.

    * held: name -> shape of every tensor the model holds (its state dict, tied copies left out);
    * stored: name -> shape of every tensor save_pretrained writes;
    * pieces: stored name -> (held name, expert, rows): the stored tensor is held[expert][rows] (None: no index);
    * joined: stored name -> [(stored rows, piece), ...]: a 2-D stored tensor that is several held pieces stacked along
      its rows (Sarvam-MoE's query_key_value: q_proj, k_proj and v_proj), each piece's rows in it. Merges apply each
      piece's change to its rows; a sharded export does not cut them (it refuses, as for any tensor without a piece).

    Read from transformers' own save-time reversal (revert_weight_conversion), applied on the meta device for names and
    shapes and to small index tensors for the pieces (which held tensor, expert and rows each stored value came from).
    A conversion that moves data other than along a tensor's first two axes maps no piece: such tensors are copied as
    they are by a merge (an adapter that targets them is refused) and refused by a sharded export."""

    def __init__(self, model, held: dict[str, tuple[int, ...]] | None = None):
        """model: the model (meta or live, whose conversions from_pretrained recorded); held: the shapes of its tensors
        (default: its state dict's; a ZeRO-3 run passes the full shapes its partitioned parameters keep in ds_shape)."""
        tied = set(tied_copies(model))
        if held is None:
            held = {n: tuple(t.shape) for n, t in model.state_dict().items() if n not in tied}
        self.held = dict(held)
        sd = {n: torch.empty(shape, device="meta") for n, shape in self.held.items()}
        self.stored = {n: tuple(t.shape) for n, t in revert_weight_conversion(model, sd).items()}
        self.pieces: dict[str, tuple] = {n: (n, None, None) for n in self.held if n in self.stored}
        self.joined: dict[str, list[tuple[slice, tuple]]] = {}
        if set(self.stored) == set(self.held):
            return
        # index probes: held tensor n's probe holds base[n] + (expert * rows + row), over its first two axes only
        base, probes, offset = {}, {}, 0
        for n, shape in self.held.items():
            lead = shape[:2] if len(shape) == 3 else shape[:1]
            count = math.prod(lead) if lead else 1
            probes[n] = (torch.arange(count, dtype=torch.float64) + offset).reshape(*lead, *[1] * (len(shape) - len(lead)))
            base[n], offset = offset, offset + count
        starts = sorted((o, n) for n, o in base.items())
        for name, v in revert_weight_conversion(model, probes).items():
            flat = v.reshape(-1).to(torch.int64)
            if flat.numel() == 0:
                continue
            if v.dim() == 2 and v.shape[1] == 1 and name not in self.held:
                parts = self._stacked(flat, starts, base)
                if parts is not None and len(parts) > 1:
                    self.joined[name] = parts
                    continue
            held_name = max((o, n) for o, n in starts if o <= int(flat[0]))[1]
            shape, local = self.held[held_name], flat - base[held_name]
            rows_per = shape[1] if len(shape) == 3 else (shape[0] if shape else 1)
            expert = (local // rows_per) if len(shape) == 3 else torch.zeros_like(local)
            row = local % rows_per if len(shape) == 3 else local
            if v.shape == probes[held_name].shape and torch.equal(local, torch.arange(local.numel())):
                piece = (held_name, None, None)
            elif len(shape) >= 2 and (expert == expert[0]).all() and torch.equal(row, torch.arange(row.numel()) + row[0]):
                rows = slice(int(row[0]), int(row[0]) + row.numel())
                piece = (held_name, int(expert[0]) if len(shape) == 3 else None, rows)
            else:
                continue
            if tuple(_cut(torch.empty(shape, device="meta"), piece).shape) == self.stored.get(name):
                self.pieces[name] = piece

    def _stacked(self, flat: torch.Tensor, starts: list, base: dict) -> list[tuple[slice, tuple]] | None:
        """A stored tensor's row probes as runs of consecutive rows of 2-D held tensors: [(stored rows, piece)], or
        None where some run is no such rows."""
        offsets = torch.tensor([o for o, _ in starts], dtype=torch.int64)
        owner = torch.searchsorted(offsets, flat, right=True)  # which held tensor each row comes from
        parts, begin = [], 0
        cuts = [i for i in range(1, len(flat)) if int(flat[i]) != int(flat[i - 1]) + 1 or owner[i] != owner[i - 1]]
        for end in [*cuts, len(flat)]:
            first = int(flat[begin])
            held_name = max((o, n) for o, n in starts if o <= first)[1]
            shape, local = self.held[held_name], first - base[held_name]
            if len(shape) != 2 or local + (end - begin) > shape[0]:
                return None
            parts.append((slice(begin, end), (held_name, None, slice(local, local + end - begin))))
            begin = end
        return parts

    @classmethod
    def of_config(cls, config_dir: Path) -> StoredLayout:
        return cls(_meta_model(config_dir))

    def plan_pieces(self, plan: dict[str, dict], stored_names: list[str]) -> dict[str, tuple]:
        """stored name -> (plan entry, piece) for the tensors a merge changes; every planned tensor must be covered."""
        todo, covered = {}, set()
        for name in stored_names:
            if name in self.joined:
                parts = [(rows, plan[p[0]], p) for rows, p in self.joined[name] if p[0] in plan]
                if any("replace" in e or "rows" in e for _, e, _ in parts):
                    continue  # a tensor replaced or grown whole is not cut into a stacked one: refused below
                if parts:
                    todo[name] = ("stacked", parts)
                    covered.update(p[0] for _, _, p in parts)
                continue
            piece = self.pieces.get(name, (name, None, None))
            if piece[0] in plan:
                todo[name] = (plan[piece[0]], None if piece[1:] == (None, None) else piece)
                covered.add(piece[0])
        missing = sorted(set(plan) - covered)
        if missing:
            raise RecipeError(f"adapter: targets '{missing[0]}', which the base model stores in a layout the streaming merge cannot map; merge with peft's merge_and_unload")
        return todo


class HubFormat:
    """A tensor source in the names the model holds (a DCP or ZeRO checkpoint) presented in the names and layout
    save_pretrained writes (StoredLayout): each stored tensor is its piece of a held one, cut when asked for; the held
    tensor of the last request is kept, and the pieces of one held tensor are consecutive in names(), so each is read
    once. Memory: one held tensor."""

    def __init__(self, source, layout: StoredLayout):
        self.source = source
        have = set(source.names())
        order = {n: i for i, n in enumerate(source.names())}
        unmapped = [n for n in layout.stored if n not in layout.pieces]
        if unmapped:
            raise RecipeError(f"export: '{unmapped[0]}' is stored in a layout the streaming export cannot cut from the "
                              "checkpoint's tensors (transformers converts it on more than the first two axes); export "
                              "with transformers' save_pretrained instead")
        missing = sorted({layout.pieces[n][0] for n in layout.stored} - have)
        if missing:
            raise RecipeError(f"export: the checkpoint lacks {len(missing)} tensors the config needs (e.g. {missing[:2]}); "
                              "the checkpoint is not of this config's model — check the source folder")
        self.map = {n: layout.pieces[n] for n in sorted(layout.stored, key=lambda n: order[layout.pieces[n][0]])}
        self.shapes = layout.stored
        self._held: tuple[str, torch.Tensor | None] = ("", None)

    def names(self) -> list[str]:
        return list(self.map)

    def meta(self, name: str):
        return self.source.meta(self.map[name][0])[0], self.shapes[name]

    def get(self, name: str) -> torch.Tensor:
        piece = self.map[name]
        if piece[1:] == (None, None):  # stored as held: nothing to keep for later pieces
            self._held = ("", None)
            return self.source.get(piece[0])
        if self._held[0] != piece[0]:
            self._held = ("", None)  # free the previous tensor before reading the next
            self._held = (piece[0], self.source.get(piece[0]))
        return _cut(self._held[1], piece)


def expected_model_tensors(config_dir: Path, held: bool = False) -> dict[str, tuple[int, ...]]:
    """name -> shape of every tensor save_pretrained writes for this config (held=True: as the model holds them; they
    differ where transformers converts a checkpoint as it loads it, see StoredLayout), tied copies (lm_head tied to the
    embeddings) left out as save_pretrained does."""
    layout = StoredLayout.of_config(config_dir)
    return layout.held if held else layout.stored
