"""TrainConfig: everything a `k3 train` run needs, in sections (data, optim, parallel, eval, checkpoint, recall,
images). Each field's docstring is its `k3 train --help` text (k3.cli_config builds the flags); a flag is the
field's flat name with dashes (--lr, --recall-fraction, --save-every), which is also the key it had in the flat
train_config.json of earlier runs (TrainConfig.from_dict reads both layouts)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from k3.checkpoint.run import FORMATS as CHECKPOINT_FORMATS
from k3.cli_config import check_positive, from_dict, from_flat, option, replace_flat, section
from k3.layers.balancing import QB_AGGREGATES, QB_PUBLISHED
from k3.runtime import DTYPE_CHOICES
from k3.train.images import VISION_TRAIN
from k3.train.master_weights import MASTER_WEIGHTS
from k3.train.schedule import check_seq_len_schedule, parse_seq_len_schedule
from k3.vision.config import VISION_PRESETS


@dataclass
class DataConfig:
    """data"""

    data: list[str] = field(default_factory=list)
    """.txt, .jsonl ("text" field) or .parquet file, or a directory of them; repeatable (none: this machine's Python
    standard library). A .jsonl of image-text records ("images" or "messages") trains the vision tower too: see the
    image-text flags below"""
    tokenizer: str | None = None
    """a tokenizer.json, tiktoken model file or tokenizer directory (default: train a byte-level BPE on the
    corpus)"""
    tokenizer_sample_mb: float = field(default=20.0, metadata=option(cli=False))
    """text used to train the BPE"""
    max_corpus_mb: float | None = None
    """read at most this much text (default: all of it)"""
    val_fraction: float = 0.05
    """share of the documents held out for validation"""
    seq_len: int = 256
    """tokens per row"""
    batch_size: int = 8
    """rows of --seq-len tokens per step, packed into one [1, batch_size * seq_len] sequence"""
    seq_len_schedule: list[list[int]] | None = field(default=None, metadata=option(parse=parse_seq_len_schedule))
    """length curriculum LENGTH:START_STEP,...: e.g. 256:0,1024:2000 trains 256-token rows, then 1024-token rows
    once 2000 steps are done, at the first stage's tokens per step (the first stage's length is --seq-len)"""

    def __post_init__(self) -> None:
        check_positive(self, "seq_len", "batch_size")
        if self.seq_len_schedule is not None:
            self.seq_len_schedule = [[int(n), int(s)] for n, s in self.seq_len_schedule]
            check_seq_len_schedule(self.seq_len_schedule)
            self.seq_len = self.seq_len_schedule[0][0]


@dataclass
class OptimConfig:
    """optimizer and balancing"""

    lr: float = 3e-3
    """peak learning rate, after a linear warmup, then cosine to min_lr_ratio of it"""
    min_lr_ratio: float = field(default=0.1, metadata=option(cli=False))
    """the cosine schedule's floor, as a share of lr"""
    warmup_steps: int = 20
    """steps of linear warmup"""
    weight_decay: float = 0.1
    """AdamW weight decay"""
    grad_clip: float = 1.0
    """clip the global gradient norm to this"""
    master_weights: str = field(default="auto", metadata=option(choices=MASTER_WEIGHTS))
    """bf16-params: the model's parameters in bf16 with fp32 masters in the optimizer (no autocast casts);
    fp32-autocast: fp32 parameters under --dtype's autocast; auto (default): bf16-params on a bf16-capable CUDA
    device in one process with --dtype auto or bf16 and full checkpoints, fp32 on CPU. Checkpoints hold fp32 weights
    either way"""
    qb_iters: int = QB_PUBLISHED
    """Quantile Balancing, research option: iterate the update on the batch being routed until every expert gets its
    quota, at most N updates per MoE layer and step (host syncs; 64 balances nearly every batch). Default 0: QB as
    published, one update per step from the current batch, applied at the next step, no host sync"""
    moe_aux_loss: float = field(default=0.0, metadata=option(cli=False))
    """coefficient of an auxiliary balancing loss (a baseline for ablations; 0: none)"""

    def __post_init__(self) -> None:
        check_positive(self, "lr")
        if self.qb_iters < 0:
            raise ValueError(f"qb_iters must be 0 (published Quantile Balancing) or a positive cap on the iterated "
                             f"solve, got {self.qb_iters}")
        if self.master_weights not in MASTER_WEIGHTS:
            raise ValueError(f"master_weights must be one of {MASTER_WEIGHTS}, got {self.master_weights!r}")


@dataclass
class ParallelConfig:
    """parallelism (under torchrun)"""

    ep: int = 0
    """expert parallelism under `torchrun --nproc-per-node N -m k3 train ... --ep P`: experts sharded over groups of
    P ranks (P divides N and the expert count; N/P groups replicate them), FSDP2 over all N; 0 (default): one
    process"""
    ep_balanced: bool = False
    """with --ep: balanced dispatch, every rank computes the same number of token-expert pairs however skewed the
    routing (the hottest experts are replicated for the step)"""
    qb_aggregate: str = field(default="gather", metadata=option(choices=QB_AGGREGATES))
    """under torchrun: how Quantile Balancing pools statistics over ranks; gather (default, exact: [tokens, experts]
    from every rank per MoE layer) or histogram (published QB: one all-reduce of E x 1000 counts per layer;
    --qb-iters: E x 256 per round; for many ranks or experts)"""
    global_batch: bool = False
    """under torchrun: --batch-size counts the rows of the whole step and every rank trains its share of one stream,
    so 1 process and N ranks see the same batches and losses, and a resume under another layout continues the same
    stream (default: every rank reads its own stream of --batch-size rows)"""

    def __post_init__(self) -> None:
        if self.qb_aggregate not in QB_AGGREGATES:
            raise ValueError(f"qb_aggregate must be one of {QB_AGGREGATES}, got {self.qb_aggregate!r}")
        if self.ep_balanced and self.ep < 2:
            raise ValueError(f"ep_balanced needs expert parallelism: give --ep 2 or more (got ep={self.ep})")


@dataclass
class EvalConfig:
    """validation"""

    every: int = 50
    """steps between validation losses"""
    batches: int = 4
    """batches of one validation"""

    def __post_init__(self) -> None:
        if self.every <= 0:
            raise ValueError(f"eval_every must be positive, got {self.every}")
        if self.batches <= 0:
            raise ValueError(f"eval_batches must be positive, got {self.batches}")


@dataclass
class CheckpointConfig:
    """checkpoints"""

    every: int = field(default=50, metadata=option(name="save_every"))
    """steps between checkpoints (one is also written at the end and when the time budget runs out)"""
    format: str = field(default="full", metadata=option(choices=CHECKPOINT_FORMATS))
    """full (default): DIR/checkpoint.pt, gathered on rank 0; sharded: DIR/checkpoint/, every rank writes its own
    shards (for models too large to gather); both resume under any layout and load in `k3 generate`"""

    def __post_init__(self) -> None:
        if self.every <= 0:
            raise ValueError(f"save_every must be positive, got {self.every}")
        if self.format not in CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format must be one of {CHECKPOINT_FORMATS}, got {self.format!r}")


@dataclass
class RecallConfig:
    """synthetic associative recall (k3.data.synthetic.RecallTask) mixed into the text"""

    fraction: float = 0.0
    """share of rows replaced by synthetic associative-recall sequences"""
    pairs: int = 8
    """key-value pairs per recall sequence"""
    queries: int = 0
    """queries per recall sequence (default 0: one per pair)"""
    length: int = 0
    """tokens per recall sequence; several are packed into a row (default 0: one per row)"""
    weight: float = 1.0
    """loss weight of a recall answer relative to a text token"""

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"recall_fraction must be in [0, 1], got {self.fraction}")
        if self.weight <= 0 or self.length < 0 or self.queries < 0:
            raise ValueError(f"recall_weight must be positive and recall_length, recall_queries >= 0; got "
                             f"{self.weight}, {self.length}, {self.queries}")


@dataclass
class ImageConfig:
    """image-text data (a --data .jsonl of {"text": "... <image> ...", "images": [...]} or {"messages": [...]} with
    image_url parts; docs/vision.md)"""

    vision: str | None = field(default=None, metadata=option(choices=sorted(VISION_PRESETS)))
    """vision preset of a new tower (k3 train: default k3 for --preset k3, else tiny; k3 sft: only when the starting
    run has no tower, default tiny)"""
    vision_train: str = field(default="all", metadata=option(choices=VISION_TRAIN))
    """all (default): tower and projector trained with the model; projector: tower frozen; none: both frozen"""
    vision_lr: float | None = None
    """peak learning rate of the vision tower and projector (default: --lr), on the same warmup + cosine schedule"""
    image_fraction: float = 0.5
    """share of each step's rows that are image-text rows, beside text rows (default 0.5); the text comes from the
    other --data files, or the default corpus"""
    max_image_patches: int | None = None
    """images are scaled down to at most this many 14-px patches (default 16384, as K2.5); an example longer than a
    row (k3 train: --seq-len) with its images is an error"""
    max_image_pixels: int | None = None
    """refuse an image with more pixels, before decoding it (decompression bombs; default Pillow's
    MAX_IMAGE_PIXELS, 89,478,485)"""
    max_image_bytes: int = field(default=32 << 20, metadata=option(help="refuse an image file or data: URL larger "
                                                                        "than this (default 32 MiB)"))
    skip_bad_images: bool = False
    """leave bad records out (missing or unreadable image, too large, placeholder count mismatch) and print their
    count, instead of stopping at the first with its file:line and field"""
    allow_image_paths_outside: bool = False
    """follow absolute image paths and paths outside the JSONL's folder (refused by default)"""


@dataclass
class TrainConfig:
    """A `k3 train` run. Build it nested (TrainConfig(optim=OptimConfig(lr=1e-3))) or by flat names, as the flags
    call the fields (TrainConfig.flat(lr=1e-3, recall_fraction=0.5))."""

    preset: str = "tiny"
    """model preset: debug, tiny, small, kimi-linear-48b, k3 (default tiny)"""
    out: str = field(default="runs/tiny", metadata=option(required=True))
    """run directory"""
    max_steps: int = 200
    """steps in all; the cosine schedule's length"""
    time_budget_s: float | None = None
    """stop (and save) once training has run this long"""
    seed: int = 0
    """seed of the weights, the data order and sampling"""
    device: str = "auto"
    """auto, cpu, cuda, cuda:N (default auto: cuda if available)"""
    dtype: str = field(default="auto", metadata=option(choices=DTYPE_CHOICES))
    """auto (default): bf16 autocast on a CUDA device with bf16 support, fp32 elsewhere"""
    cuda_graph: bool | None = field(default=None, metadata=option(
        negative="eager", negative_help="the eager step on CUDA too (for debugging: one kernel launch at a time, any "
                                        "batch)"))
    """replay each step's forward and backward from one CUDA graph (k3.train.graphed_step; the default on a CUDA
    device in one process): no host launch overhead, packed documents kept apart through static shapes (a batch with
    more documents than the graph holds takes the eager step). The iterated QB (--qb-iters) solves on the device with
    min(qb_iters, QB_GRAPH_UPDATES) updates"""
    max_documents_per_row: int = field(default=0, metadata=option(cli=False))
    """the graphed step's static document count per row; 0: max(16, seq_len // 128)"""
    log_every: int = field(default=0, metadata=option(metavar="N"))
    """read the step's metrics from the device every N steps in one sync (every step's values are still written;
    step_seconds is the window's mean); default 0: 10 on CUDA (a read per step stalls the host's queue of work), 1
    elsewhere"""
    model_overrides: dict[str, Any] = field(default_factory=dict, metadata=option(cli=False))
    """ModelConfig fields that replace the preset's"""
    data: DataConfig = section(DataConfig)
    optim: OptimConfig = section(OptimConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    eval: EvalConfig = section(EvalConfig, prefix="eval")
    checkpoint: CheckpointConfig = section(CheckpointConfig, prefix="checkpoint")
    recall: RecallConfig = section(RecallConfig, prefix="recall")
    images: ImageConfig = section(ImageConfig)

    def __post_init__(self) -> None:
        check_positive(self, "max_steps")
        if self.log_every < 0:
            raise ValueError(f"log_every must be 0 (auto: 10 on CUDA, 1 elsewhere) or a positive step count, got "
                             f"{self.log_every}")
        if self.cuda_graph and self.parallel.ep:  # an explicit --cuda-graph; the default (None) turns it off under --ep
            raise ValueError("cuda_graph runs on one process (QB over ranks syncs with the host); drop --ep or "
                             "--cuda-graph")
        if self.optim.master_weights == "bf16-params" and (self.dtype == "fp32" or self.parallel.ep
                                                           or self.checkpoint.format == "sharded"):
            raise ValueError("master_weights bf16-params runs bf16 parameters in one process with full checkpoints; "
                             f"got dtype={self.dtype!r}, ep={self.parallel.ep}, "
                             f"checkpoint_format={self.checkpoint.format!r} (use --master-weights fp32-autocast, or "
                             f"drop those options)")

    @classmethod
    def flat(cls, **fields: Any) -> TrainConfig:
        """Built from flat names, as the flags call the fields: TrainConfig.flat(lr=1e-3, save_every=10)."""
        return from_flat(cls, fields)

    def replace(self, **fields: Any) -> TrainConfig:
        """A copy with the fields named by flat name replaced: config.replace(max_steps=400, ep=0)."""
        return replace_flat(self, fields)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """A saved train_config.json or checkpoint["train"]: the sectioned layout, or the flat one of earlier runs."""
        return from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
