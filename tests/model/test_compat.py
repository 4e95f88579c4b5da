"""The upstream shims (sftrecipes/model/compat.py): one canary per shim that runs the upstream code without it and expects the
upstream failure (when upstream fixes the gap the canary fails: drop the shim), the version guard, and the pins.

The canaries call the upstream function directly on the tiny model (seconds), not a training run; tests/launch/test_twins.py
and tests/export/test_export.py train through the shims.
"""

import logging
import re
import subprocess
import sys

import pytest
from conftest import ROOT, free_port

from sftrecipes.model import compat


def fixed_upstream(name: str) -> str:
    shim = compat.SHIMS[name]
    found = ", ".join(f"{d} {compat.installed_version(d)}" for d, _ in shim.written_for)
    return (f"upstream ({found}) no longer fails the way compat.{name} works around ({shim.gap}): "
            f"drop the shim from sftrecipes/model/compat.py and its call in backends.apply_process_env")


def test_every_shim_has_a_canary():
    canaries = {n[len("test_canary_"):] for n in globals() if n.startswith("test_canary_")}
    assert canaries == set(compat.SHIMS)


def test_pins_lie_inside_every_shims_range():
    """requirements.txt pins what the shims were written against: bumping a pin past a shim's range must come with
    a look at the shim (its canary tells whether it is still needed)."""
    from packaging.specifiers import SpecifierSet

    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (ROOT / "requirements.txt").read_text(), re.M))
    for shim in compat.SHIMS.values():
        for dist, spec in shim.written_for:
            assert dist in pins, f"{shim.name}: {dist} is not pinned in requirements.txt"
            assert pins[dist] in SpecifierSet(spec), f"{shim.name} was written for {dist}{spec}, requirements.txt pins {pins[dist]}"


# Where each shim changes upstream: (module, attribute path). The guard test checks they stay upstream's.
TARGETS = {
    "enable_fsdp_on_cpu": ("accelerate.state", "AcceleratorState.__init__"),
    "fix_peft_prefixes_under_wrappers": ("peft.tuners.tuners_utils", "_get_tuner_state_dict_key_prefixes"),
    "trainable_token_heads_for_trl": ("peft.utils.other", "TrainableTokensWrapper._getattr_wrapped"),
    "trainable_tokens_init_under_zero3_on_cpu": ("peft.tuners.trainable_tokens.layer", "TrainableTokensLayer._collect_token_weights"),
    "keep_dense_linears_in_moe_conversion": ("peft.utils.transformers_weight_conversion", "_convert_peft_config_moe"),
    "backbone_under_a_stale_prefix": ("transformers.modeling_utils", "PreTrainedModel.base_model"),
    "num_experts_for_trl": ("trl.trainer.sft_trainer", "add_fused_lm_head"),
    "buffers_in_ram_efficient_fsdp2": ("accelerate.utils.fsdp_utils", "fsdp2_load_full_state_dict"),
    "loaded_modules_skip_init_under_zero3": ("transformers.modeling_utils", "PreTrainedModel._initialize_weights"),
    "split_sizes_from_full_shapes_under_zero3": ("transformers.core_model_loading", "Split.convert"),
    "no_shm_comm_kernel_on_cpu": ("deepspeed.comm.torch", "build_shm_op"),
}


def _target(name):
    import importlib

    module, path = TARGETS[name]
    obj = importlib.import_module(module)
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_guard_leaves_upstream_alone_outside_the_range(name, monkeypatch, caplog):
    """On an upstream version the shim was not written for it is not applied, and one warning line says so and what
    to check; in range it is applied."""
    assert set(TARGETS) == set(compat.SHIMS)
    shim = compat.SHIMS[name]
    with compat.upstream(name):
        before = _target(name)
        monkeypatch.setattr(compat, "installed_version", lambda dist: "99.0.0")
        with caplog.at_level(logging.WARNING, logger="sftrecipes"):
            shim.apply()
        assert _target(name) is before
        lines = [r.getMessage() for r in caplog.records if name in r.getMessage()]
        assert len(lines) == 1 and "\n" not in lines[0], lines
        assert "NOT applied" in lines[0] and "99.0.0" in lines[0] and f"-k {name}" in lines[0]
        monkeypatch.undo()
        shim.apply()
        assert _target(name) is not before


def test_upstream_restores_what_it_found():
    """upstream() puts the shim back exactly when it was applied before the block."""
    from peft.utils.other import TrainableTokensWrapper

    name = "trainable_token_heads_for_trl"
    with compat.upstream(name):
        plain = TrainableTokensWrapper._getattr_wrapped
        compat.trainable_token_heads_for_trl()
        shimmed = TrainableTokensWrapper._getattr_wrapped
        assert shimmed is not plain
        with compat.upstream(name):
            assert TrainableTokensWrapper._getattr_wrapped is plain
        assert TrainableTokensWrapper._getattr_wrapped is not plain
    assert TrainableTokensWrapper._getattr_wrapped is not shimmed


# --- canaries: the upstream code without the shim still fails --------------------------------------------------

ACCELERATE_CANARY = """
import os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[1], OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import FullyShardedDataParallelPlugin
from sftrecipes.model import compat
plugin = lambda: FullyShardedDataParallelPlugin(fsdp_version=2)
print("upstream", Accelerator(cpu=True, fsdp_plugin=plugin()).state.distributed_type)
AcceleratorState._reset_state(True)
compat.enable_fsdp_on_cpu()
print("shimmed", Accelerator(cpu=True, fsdp_plugin=plugin()).state.distributed_type)
"""


def test_canary_enable_fsdp_on_cpu():
    """accelerate keeps a CPU run with an FSDP plugin as MULTI_CPU (it then wraps the model in DDP); the shim makes it
    FSDP. A fresh process: accelerate's state and the process group are per process."""
    r = subprocess.run([sys.executable, "-c", ACCELERATE_CANARY, str(free_port())], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = dict(line.split() for line in r.stdout.splitlines() if line.startswith(("upstream", "shimmed")))
    assert got["upstream"] == "DistributedType.MULTI_CPU", fixed_upstream("enable_fsdp_on_cpu") + f" (got {got['upstream']})"
    assert got["shimmed"] == "DistributedType.FSDP", got


BUFFER_CANARY = """
import os, sys, types
os.environ.update(OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
import accelerate.utils.fsdp_utils as fsdp_utils
from sftrecipes.model import compat
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))

class Router(torch.nn.Module):  # a weight and a persistent buffer, as DeepSeek-V3's router has
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 8))
        self.register_buffer("e_score_correction_bias", torch.arange(4.0) + 1)

    def get_parameter_or_buffer(self, name):  # what transformers models have and accelerate reads
        return self.get_parameter(name) if name in dict(self.named_parameters()) else self.get_buffer(name)

def load():
    full = Router().state_dict()
    with torch.device("meta"):
        model = Router()
    fully_shard(model, mesh=mesh)
    accelerator = types.SimpleNamespace(is_main_process=True, device=torch.device("cpu"))
    fsdp_utils.fsdp2_load_full_state_dict(accelerator, model, full)
    ok = torch.equal(model.weight.full_tensor(), full["weight"]) and torch.equal(model.e_score_correction_bias, full["e_score_correction_bias"])
    return ok and "e_score_correction_bias" in model.state_dict()

try:
    load()
    print("upstream loads")
except AttributeError as e:
    print("upstream fails", type(e).__name__, e)
compat.buffers_in_ram_efficient_fsdp2()
print("shimmed", load())
"""


def test_canary_buffers_in_ram_efficient_fsdp2():
    """accelerate's RAM-efficient FSDP2 load reads a device mesh off every state-dict entry, and a persistent buffer
    has none; under the shim the buffer arrives whole, still persistent, the weight sharded. A fresh process: a
    1-rank gloo group on a free port."""
    r = subprocess.run([sys.executable, "-c", BUFFER_CANARY, str(free_port())], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "upstream fails AttributeError" in r.stdout and "device_mesh" in r.stdout, fixed_upstream("buffers_in_ram_efficient_fsdp2") + r.stdout
    assert "shimmed True" in r.stdout, r.stdout + r.stderr[-2000:]


def _peft_model(tiny_model, **lora):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    return model, lambda m: get_peft_model(m, LoraConfig(target_modules=["q_proj"], **lora))


def test_canary_fix_peft_prefixes_under_wrappers(tiny_model):
    """Under activation-checkpoint wrappers (as under FSDP1 nesting) peft finds none of the adapter's tensors."""
    from peft import get_peft_model_state_dict
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    base, wrap = _peft_model(tiny_model)
    model = wrap(base)
    plain = len(get_peft_model_state_dict(model))
    assert plain > 0
    apply_activation_checkpointing(model, check_fn=lambda m: type(m).__name__.endswith("DecoderLayer"))
    name = "fix_peft_prefixes_under_wrappers"
    with compat.upstream(name):
        assert len(get_peft_model_state_dict(model)) == 0, fixed_upstream(name)
        compat.fix_peft_prefixes_under_wrappers()
        assert len(get_peft_model_state_dict(model)) == plain


def test_canary_trainable_token_heads_for_trl(tiny_model):
    """TRL's fused LM head (on in SFTTrainer) reads lm_head.bias; peft's trainable-token wrapper of the head has none."""
    import torch
    from trl.trainer.utils import add_fused_lm_head

    base, wrap = _peft_model(tiny_model, trainable_token_indices={"lm_head": [0, 1]})
    add_fused_lm_head(base)
    model = wrap(base)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    name = "trainable_token_heads_for_trl"
    with compat.upstream(name):
        try:
            model(input_ids=ids, labels=ids, fused_lm_head=True)
        except AttributeError as e:
            assert "bias" in str(e), e
        else:
            pytest.fail(fixed_upstream(name))
        compat.trainable_token_heads_for_trl()
        loss = model(input_ids=ids, labels=ids, fused_lm_head=True).loss
        assert torch.isfinite(loss)


def test_canary_trainable_tokens_init_under_zero3_on_cpu():
    """peft's ZeRO-3 init of new token rows builds its broadcast buffer on CUDA, which the cpu target has not (the
    suite hides CUDA unless SFT_GPU_TESTS=1; the shim applies on the cpu target only)."""
    import torch
    from peft.tuners.trainable_tokens.layer import TrainableTokensLayer

    if torch.cuda.is_available():
        pytest.skip("CUDA is visible: the shim is for the cpu target")
    name = "trainable_tokens_init_under_zero3_on_cpu"
    with compat.upstream(name):
        try:
            TrainableTokensLayer._collect_token_weights(None, torch.zeros(8, 4), torch.tensor([1, 2]), 4)
        except (AssertionError, RuntimeError) as e:
            if "CUDA" not in str(e):
                pytest.fail(fixed_upstream(name) + f" (it now fails otherwise: {e})")
        else:
            pytest.fail(fixed_upstream(name))


def test_canary_loaded_modules_skip_init_under_zero3():
    """RWKV's _init_weights reads its embedding's shape; under ZeRO-3 a loaded parameter is a 0-element partition
    (ds_id set, marked loaded): upstream fails there, the shim skips the module and leaves its weight as it was."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from sftrecipes.tiny_archs import tiny_config

    name = "loaded_modules_skip_init_under_zero3"

    def partitioned():
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("rwkv")))
        for p in model.parameters():  # what zero.Init leaves on a rank: a partition, its full shape in ds_shape
            p.ds_id, p.ds_shape, p._is_hf_initialized = id(p), tuple(p.shape), True
            p.data = torch.empty(0, dtype=p.dtype)
        for b in model.buffers():
            b._is_hf_initialized = True
        for m in model.modules():  # a model just loaded: no module is marked yet (from_config marked them all)
            vars(m).pop("_is_hf_initialized", None)
        return model

    with compat.upstream(name):
        with pytest.raises(IndexError):
            partitioned().initialize_weights()
    model = partitioned()
    compat.SHIMS[name].apply()
    model.initialize_weights()
    assert all(p.numel() == 0 for p in model.parameters())


def test_canary_split_sizes_from_full_shapes_under_zero3():
    """A fused q|k|v checkpoint tensor split for parameters that are ZeRO-3 partitions (0 elements, the full shape in
    ds_shape): upstream sizes the pieces by the partitions and fails; the shim cuts the rows each target has."""
    import torch
    from transformers.core_model_loading import Split

    model = torch.nn.Module()
    for name, rows in (("q_proj", 8), ("k_proj", 4), ("v_proj", 4)):
        layer = torch.nn.Linear(6, rows, bias=False)
        layer.weight.data = torch.empty(0)
        layer.weight.ds_shape = (rows, 6)
        model.add_module(name, layer)
    fused = torch.arange(16 * 6, dtype=torch.float32).reshape(16, 6)
    args = ({"qkv.weight": fused}, ["qkv"], ["q_proj", "k_proj", "v_proj"], "q_proj.weight", model)
    name = "split_sizes_from_full_shapes_under_zero3"
    with compat.upstream(name):
        with pytest.raises(RuntimeError, match="split"):
            Split(dim=0).convert(*args)
    compat.SHIMS[name].apply()
    got = Split(dim=0).convert(*args)
    assert [tuple(got[t].shape) for t in ("q_proj", "k_proj", "v_proj")] == [(8, 6), (4, 6), (4, 6)]
    assert torch.equal(torch.cat([got["q_proj"], got["k_proj"], got["v_proj"]]), fused)


def test_canary_keep_dense_linears_in_moe_conversion():
    """peft's v4->v5 MoE conversion takes gate/up/down_proj for the fused experts' tensors and drops them from
    target_modules, though a dense layer's MLP (DeepSeek-V3's first_k_dense_replace layers) still has nn.Linear modules
    of those names: without the shim they get no LoRA."""
    import torch
    from peft import LoraConfig
    from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    from sftrecipes.tiny_archs import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("deepseek_v3")))
    assert isinstance(model.model.layers[0].mlp.gate_proj, torch.nn.Linear)  # layer 0 is dense

    def converted():
        config = LoraConfig(r=8, target_modules=["q_a_proj", "gate_proj", "up_proj", "down_proj"])
        convert_peft_config_for_transformers(config, model=model, conversions=None)
        return set(config.target_modules), set(config.target_parameters or ())

    name = "keep_dense_linears_in_moe_conversion"
    with compat.upstream(name):
        modules, params = converted()
        if "gate_proj" in modules:
            pytest.fail(fixed_upstream(name))
        assert "gate_up_proj" in params
        compat.keep_dense_linears_in_moe_conversion()
        modules, params = converted()
        assert {"q_a_proj", "gate_proj", "up_proj", "down_proj"} <= modules and {"gate_up_proj", "down_proj"} <= params


def test_canary_backbone_under_a_stale_prefix():
    """Llama4ForCausalLM declares base_model_prefix 'language_model' but holds its backbone as `model`: upstream's
    base_model is the CausalLM itself, and TRL's fused head fails on its output."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from sftrecipes.tiny_archs import tiny_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("llama4_text", vocab_size=64)))
    add_fused_lm_head(model)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    name = "backbone_under_a_stale_prefix"
    with compat.upstream(name):
        try:
            model(input_ids=ids, labels=ids, fused_lm_head=True)
        except AttributeError as e:
            assert "last_hidden_state" in str(e), e
        else:
            pytest.fail(fixed_upstream(name))
        compat.backbone_under_a_stale_prefix()
        assert model.base_model is model.model
        assert torch.isfinite(model(input_ids=ids, labels=ids, fused_lm_head=True).loss)


@pytest.mark.parametrize("mt", ["llama4_text", "deepseek_v4", "granitemoe", "phimoe"])
def test_canary_num_experts_for_trl(mt):
    """These MoE configs have no num_experts (TRL's aux loss reads it); once the trainer's fused head is installed
    under the shim, it is their own expert count, and a saved config gains no key."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from trl.trainer import sft_trainer

    from sftrecipes.tiny_archs import tiny_config

    name = "num_experts_for_trl"
    with compat.upstream(name):
        cfg = AutoConfig.for_model(**tiny_config(mt, vocab_size=64))
        text = cfg.get_text_config()
        if hasattr(text, "num_experts"):
            pytest.fail(fixed_upstream(name))
        compat.num_experts_for_trl()
        torch.manual_seed(0)
        sft_trainer.add_fused_lm_head(AutoModelForCausalLM.from_config(cfg))
        text = AutoConfig.for_model(**tiny_config(mt, vocab_size=64)).get_text_config()
        assert text.num_experts == 4 and "num_experts" not in text.to_dict()
        for other in ("kimi_linear", "bailing_hybrid"):  # num_experts their own (what num_local_experts aliases)
            sft_trainer.add_fused_lm_head(AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config(other, vocab_size=64))))
            assert AutoConfig.for_model(**tiny_config(other, vocab_size=64)).num_experts == 4


def test_canary_no_shm_comm_kernel_on_cpu(monkeypatch):
    """Upstream's CPU communication set-up still builds the shared-memory kernel: TorchBackend calls build_shm_op,
    which loads (JIT-compiles) ShareMemCommBuilder's op on the cpu accelerator. The load is intercepted here (no
    compile); with the shim nothing is loaded, and inference_all_reduce, its only user, falls back to the process
    group when the kernel is absent."""
    import importlib
    import inspect

    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    if get_accelerator().device_name() != "cpu":
        pytest.skip("DeepSpeed's accelerator is not cpu here: the shim is for the cpu target")
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    name = "no_shm_comm_kernel_on_cpu"
    loads = []
    monkeypatch.setattr(ShareMemCommBuilder, "load", lambda self, *a, **k: loads.append(self.NAME) or "kernel")
    compat.no_shm_comm_kernel_on_cpu()
    assert ds_torch.build_shm_op() is None and loads == []
    with compat.upstream(name):
        assert "build_shm_op()" in inspect.getsource(ds_torch.TorchBackend.__init__), fixed_upstream(name)
        assert ds_torch.build_shm_op() == "kernel" and loads == [ShareMemCommBuilder.NAME], fixed_upstream(name)
    assert "shm_comm_op" not in inspect.getsource(ds_torch.TorchBackend.all_reduce)  # training's all_reduce: gloo's
