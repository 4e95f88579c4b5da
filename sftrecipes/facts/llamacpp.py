"""The llama.cpp release GGUF exports are made and checked with, and where its parts are: the runtime and quantizer
(llama-cpp-python, built from source once by `make gguf-client`) and the converter scripts of the same release
(unpacked from that release's source archive into the virtual environment). Torch-free: cli.py asks before torch loads.

    python -m sftrecipes.facts.llamacpp      unpack the converter of the pinned release (pip's cache keeps the archive)
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from sftrecipes.core.errors import RecipeError

RELEASE = "0.3.36"  # llama-cpp-python; its source archive vendors the llama.cpp it builds, converter included
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion", "gguf-py", "LICENSE")
FIX = "make gguf-client (a one-time build of llama.cpp, about 25 min on 2 cores; pip's cache keeps it)"

# the types the converter writes itself; every other --quant goes through llama.cpp's quantizer from one of these
CONVERTER_TYPES = ("f32", "f16", "bf16", "q8_0")


def converter_dir() -> Path:
    """Where the converter of RELEASE is unpacked: $SFTRECIPES_LLAMACPP, else inside the virtual environment."""
    env = os.environ.get("SFTRECIPES_LLAMACPP")
    return Path(env) if env else Path(sys.prefix) / "share" / "sftrecipes" / f"llama.cpp-{RELEASE}"


def runtime_version() -> str | None:
    try:
        return importlib.metadata.version("llama_cpp_python")
    except importlib.metadata.PackageNotFoundError:
        return None


def require() -> Path:
    """The converter's folder, once the runtime of RELEASE and its converter are both here; else one line naming the fix."""
    have = runtime_version()
    if have is None:
        raise RecipeError(f"export --to gguf: llama.cpp's runtime (llama-cpp-python {RELEASE}) is not installed; {FIX}")
    if have != RELEASE:
        raise RecipeError(f"export --to gguf: llama-cpp-python {have} is installed, exports are made and checked with "
                          f"{RELEASE}; {FIX}")
    conv = converter_dir()
    if not (conv / "convert_hf_to_gguf.py").is_file():
        raise RecipeError(f"export --to gguf: llama.cpp's converter is not unpacked in {conv}; {FIX}")
    return conv


def quant_types() -> dict[str, int]:
    """--quant names and llama.cpp's file types, read from the runtime's own constants (LLAMA_FTYPE_MOSTLY_*)."""
    import llama_cpp  # the ctypes binding: no torch

    return {name[len("LLAMA_FTYPE_MOSTLY_"):].lower(): value for name, value in vars(llama_cpp).items()
            if name.startswith("LLAMA_FTYPE_MOSTLY_") and isinstance(value, int)} | {"f32": llama_cpp.LLAMA_FTYPE_ALL_F32}


def check_quant(quant: str) -> str:
    quant = quant.lower()
    known = quant_types()
    if quant not in known:
        raise RecipeError(f"export --quant: '{quant}' is not a type llama.cpp {RELEASE} writes; use one of "
                          f"{', '.join(sorted(known))}")
    return quant


# adapter_config.json features a GGUF LoRA cannot hold (llama.cpp applies W + alpha/r * B@A to the weights it targets)
NOT_IN_GGUF_LORA = {
    "use_dora": "DoRA (use_dora: a learned magnitude per output)",
    "modules_to_save": "modules_to_save (full copies of {}: not LoRA pairs)",
    "alpha_pattern": "alpha_pattern (a lora_alpha per module; a GGUF LoRA holds one)",
    "rank_pattern": "rank_pattern (a rank per module)",
    "lora_bias": "lora_bias (a bias in lora_B)",
    "layer_replication": "layer_replication (duplicated layers)",
    "trainable_token_indices": "new tokens trained as embedding rows (trainable_token_indices: the run added tokens "
                               "its base GGUF would lack)",
}


def check_gguf_lora(cfg: dict) -> None:
    """One line naming what of this adapter a GGUF LoRA cannot hold, if anything."""
    held = [why.format(", ".join(cfg[k]) if isinstance(cfg[k], list) else cfg[k])
            for k, why in NOT_IN_GGUF_LORA.items() if cfg.get(k)]
    if held:
        raise RecipeError(f"export --lora: the adapter has {'; '.join(held)}, which a GGUF LoRA cannot hold; drop --lora "
                          "to export the adapter merged into its base")


def unpack(dest: Path | None = None) -> Path:
    """The converter of RELEASE unpacked into `dest`: its source archive fetched by pip (from pip's cache when it has
    it), only the converter's parts kept. Written beside and renamed into place, so a cut unpack leaves nothing."""
    dest = dest or converter_dir()
    if (dest / "convert_hf_to_gguf.py").is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={RELEASE}", "-d", tmp], check=True)
        archive = next(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        top = f"llama_cpp_python-{RELEASE}/vendor/llama.cpp/"
        stage = Path(tmp) / "llama.cpp"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(top)
                       and m.name[len(top):].split("/")[0] in CONVERTER_PARTS and (m.isfile() or m.isdir())]
            for m in members:
                m.name = m.name[len(top):]
            tar.extractall(stage, members=members, filter="data")
        if dest.exists():
            shutil.rmtree(dest)
        stage.rename(dest)
    return dest


if __name__ == "__main__":
    print(f"llama.cpp converter of llama-cpp-python {RELEASE}: {unpack()}")
