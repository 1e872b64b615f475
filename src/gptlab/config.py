"""Configuration dataclasses: one flat, typed config per concern, validated on construction.

Every config can be turned into a plain dict (saved as JSON beside each checkpoint) and built back
from one; an unknown key, a value of the wrong type or an impossible combination raises a
ValueError naming the field, the bad value and what to do instead. `parameter_count` sizes a model
from its config alone, by the handout's arithmetic, without building it (and without torch). The
machinery they share (`Config`, `option`, `SettingError`, the checks) is gptlab.settings.

Glossary (the handout's letters beside our field names): L = n_layer, H = n_head, D = n_embd,
T_max = block_size, Vocab = vocab_size, d_h = D / H (the head size, "hs" in shape comments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# re-exported: callers import these from gptlab.config
from gptlab.settings import Config as Config
from gptlab.settings import SettingError as SettingError
from gptlab.settings import check_choice as check_choice
from gptlab.settings import check_positive as check_positive
from gptlab.settings import flag as flag
from gptlab.settings import option as option

NORMS = ("layernorm", "rmsnorm", "none")
ARRANGEMENTS = ("pre", "post")
FFNS = ("gelu", "gelu_exact", "relu", "relu2", "swiglu", "none")
POSITIONS = ("learned", "sinusoidal", "rope", "none")
ATTENTION_KERNELS = ("sdpa", "naive")


@dataclass
class ModelConfig(Config):
    """The decoder-only Transformer's shape and architectural options (handout §2-§7); `norm="none"`
    exists for the handout's §7.4 toy trace, which has no normalisation."""

    vocab_size: int = option(256, "vocabulary size V (set from the tokenizer when training)")
    block_size: int = option(256, "context window T_max: the most tokens the model sees at once")
    n_layer: int = option(4, "number of blocks L")
    n_head: int = option(4, "attention heads H per block; must divide n_embd")
    n_kv_head: int | None = option(None, "key/value heads (grouped-query attention, a departure from §4, "
                                   "where every head has its own keys and values): each serves n_head / "
                                   "n_kv_head query heads; 1 is multi-query; default n_head")
    n_embd: int = option(128, "model width D")
    ffn_mult: float = option(4.0, "feed-forward width F = ffn_mult * D (§5: D_ff = 4D)")
    norm: str = option("layernorm", "normalisation (§5, §9.3)", NORMS)
    arrangement: str = option("pre", "where the norms sit: pre-norm x + g(LN(x)) or post-norm LN(x + g(x))",
                              ARRANGEMENTS)
    ffn: str = option("gelu", "feed-forward activation: gelu is GPT-2's tanh form, gelu_exact the erf form "
                      "(nanoGPT's), relu2 is ReLU squared; swiglu is the gated FFN of §9.3; none leaves "
                      "the FFN out (attention-only blocks, a departure from §5, where every block has one)",
                      FFNS)
    positions: str = option("learned", "position information (§6)", POSITIONS)
    tied: bool = option(True, "vocabulary head shares the token embedding E (§6)")
    bias: bool = option(True, "biases in linear layers and LayerNorm")
    qkv_bias: bool | None = option(None, "biases in the fused QKV projection only (Qwen2 has them without "
                                   "the others); default: as bias")
    dropout: float = option(0.0, "dropout on embeddings and residual updates, in [0, 1)")
    attention: str = option("sdpa", "attention kernel: fused sdpa, or naive explicit scores/mask/softmax",
                            ATTENTION_KERNELS)
    causal: bool = option(True, "mask the future in every block (§7.3); off only for demos and encoders")
    norm_eps: float = option(1e-5, "epsilon inside the norms")
    rope_base: float = option(10000.0, "RoPE frequency base")
    # Options borrowed from the GPU speedrun (modded-nanogpt), each off by default; see model.py.
    qk_norm: bool = option(False, "RMS-normalise each head's queries and keys over the head features, with a "
                           "learned gain per feature (one for queries, one for keys), before RoPE and the "
                           "scores (a departure from §4)")
    logit_softcap: float = option(0.0, "when > 0, the logits become cap * tanh(logits / cap), squashed into "
                                  "(-cap, cap) smoothly, for the loss and for generation (0: off)")
    zero_init: bool = option(False, "initialise the projections into the residual stream (attention's and "
                             "the FFN's c_proj) to zero, so every pre-norm block starts as the identity "
                             "(default: GPT-2's normal init scaled by depth)")
    unet: bool = option(False, "U-net skips: the stream after each block of the first half is added back, "
                        "last kept first, before the mirror block of the second half, times a learned "
                        "weight that starts at 1 (an odd middle block gets none)")
    ngram_embeddings: tuple[int, ...] = option((), "n-gram embedding orders, e.g. 2 3: for each order n a "
                                               "row looked up by the token and the n - 1 before it is added "
                                               "to the token's own row (a departure from §6; positions.py)")
    ngram_table_size: int = option(16384, "rows of an n-gram table: exact when (V + 1)^n fit, else hashed")

    def validate(self) -> None:
        owner = "ModelConfig"
        check_positive(
            owner,
            vocab_size=self.vocab_size,
            block_size=self.block_size,
            n_layer=self.n_layer,
            n_head=self.n_head,
            n_embd=self.n_embd,
            ffn_mult=self.ffn_mult,
            norm_eps=self.norm_eps,
            rope_base=self.rope_base,
            ngram_table_size=self.ngram_table_size,
        )
        if self.n_kv_head is not None and (self.n_kv_head < 1 or self.n_head % self.n_kv_head):
            raise ValueError(f"{owner}.n_kv_head={self.n_kv_head} must divide n_head={self.n_head}: every "
                             "key/value head serves the same number of query heads")
        check_choice(owner, "norm", self.norm, NORMS)
        check_choice(owner, "arrangement", self.arrangement, ARRANGEMENTS)
        check_choice(owner, "ffn", self.ffn, FFNS)
        check_choice(owner, "positions", self.positions, POSITIONS)
        check_choice(owner, "attention", self.attention, ATTENTION_KERNELS)
        if self.n_embd % self.n_head:
            nearest = self.n_head * max(1, round(self.n_embd / self.n_head))
            raise ValueError(
                f"{owner}.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                f"choose n_embd as a multiple of n_head (for example {nearest})"
            )
        if self.positions == "rope" and self.head_size % 2:
            raise ValueError(
                f"{owner}.positions='rope' needs an even head size, but n_embd/n_head = "
                f"{self.n_embd}/{self.n_head} = {self.head_size}: change n_embd or n_head"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"{owner}.dropout={self.dropout} must be in [0, 1)")
        if len(set(self.ngram_embeddings)) < len(self.ngram_embeddings):
            raise ValueError(f"{owner}.ngram_embeddings={list(self.ngram_embeddings)} repeats an order: "
                             "give each order once")
        if any(not 2 <= n <= self.block_size for n in self.ngram_embeddings):
            raise ValueError(f"{owner}.ngram_embeddings={list(self.ngram_embeddings)}: each order must be "
                             f"from 2 (bigrams) to block_size={self.block_size}")
        if self.logit_softcap < 0:
            raise ValueError(f"{owner}.logit_softcap={self.logit_softcap} must be >= 0: a cap such as 30, "
                             "or 0 for no cap")
        if self.ffn_hidden < 1:
            raise ValueError(
                f"{owner}.ffn_mult={self.ffn_mult} gives no feed-forward units at n_embd={self.n_embd}"
            )

    @property
    def head_size(self) -> int:
        """d_h = D / H (§4)."""
        return self.n_embd // self.n_head

    @property
    def kv_heads(self) -> int:
        """Key/value heads per block: n_kv_head, or n_head (every head its own, §4)."""
        return self.n_head if self.n_kv_head is None else self.n_kv_head

    @property
    def attn_bias(self) -> bool:
        """Whether the fused QKV projection has biases."""
        return self.bias if self.qkv_bias is None else self.qkv_bias

    @property
    def ffn_hidden(self) -> int:
        """F, the feed-forward width (ffn_mult * D, rounded down; 1536 / 576 * 576 is 1536, not 1535)."""
        return int(self.ffn_mult * self.n_embd + 1e-6)


def parameter_count(config: ModelConfig) -> dict[str, int]:
    """Parameters per component, by the handout's arithmetic (§4: 3D^2 + D^2 per attention; §6)."""
    D, F_, V, L = config.n_embd, config.ffn_hidden, config.vocab_size, config.n_layer
    bias = int(config.bias)
    norm = {"layernorm": D + bias * D, "rmsnorm": D, "none": 0}[config.norm]
    norms_per_block = 1 if config.ffn == "none" else 2
    qk_norms = 2 * config.head_size if config.qk_norm else 0  # one gain (hs,) for queries, one for keys
    qkv = D + 2 * config.kv_heads * config.head_size  # widths of Q, K and V: 3D unless heads are grouped
    attention = D * qkv + D * D + int(config.attn_bias) * qkv + bias * D  # W_QKV and W_O
    if config.ffn == "swiglu":
        ffn = 3 * D * F_ + bias * (2 * F_ + D)
    elif config.ffn == "none":  # attention-only: no FFN, and so no norm before it
        ffn = 0
    else:
        ffn = 2 * D * F_ + bias * (F_ + D)
    counts = {
        "token embedding": V * D,
        "positions": config.block_size * D if config.positions == "learned" else 0,
        "attention": L * attention,
        "feed-forward": L * ffn,
        "norms": L * (norms_per_block * norm + qk_norms) + (norm if config.arrangement == "pre" else 0),
        "skip weights": L // 2 if config.unet else 0,
        "n-gram tables": D * sum(min(config.ngram_table_size, (V + 1) ** n) for n in config.ngram_embeddings),
        "vocabulary head": 0 if config.tied else V * D,
    }
    counts["total"] = sum(counts.values())
    return counts


PRECISIONS = ("auto", "float32", "bfloat16")
MUON_PRECISIONS = ("auto", "bfloat16", "float32")
PARALLEL = ("ddp", "fsdp")
CHECKPOINT_FORMATS = ("auto", "file", "sharded")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "trapezoid")
LOGS = ("tensorboard", "wandb")
CORPORA = ("shakespeare", "python-stdlib", "repeats")  # built-in texts (data.corpora), besides files
TOKENIZERS = ("char", "byte", "bpe", "gpt2")  # the kinds a run trains or takes (text.tokenizer)
DETECTORS = ("previous_token", "duplicate_token", "induction", "first_token")  # inspection.detectors


@dataclass
class TrainConfig(Config):
    """How to train: batch, schedule, optimiser, evaluation and precision."""

    batch_size: int = option(12, "sequences per micro-batch")
    grad_accum: int = option(1, "micro-batches summed into one optimiser step")
    max_steps: int = option(2000, "optimiser steps (with --resume: a larger value extends a run)")
    lr: float = option(1e-3, "peak learning rate (AdamW)")
    min_lr: float = option(1e-4, "learning rate at the end of the decay")
    warmup_steps: int = option(100, "steps of linear warm-up from 0 to lr")
    decay_steps: int | None = option(None, "the decay reaches min_lr at this step and stays there "
                                     "(default: max_steps; extending a run keeps its first max_steps)")
    schedule: str = option("cosine", "after the warm-up: a cosine decay to min_lr at decay_steps, or "
                           "trapezoid: constant at lr, then a linear cool-down to min_lr over the last "
                           "--cooldown of decay_steps", SCHEDULES)
    cooldown: float = option(0.2, "the trapezoid's cool-down, as a fraction of decay_steps, in [0, 1]")
    batch_warmup: int = option(0, "grow the sequences per micro-batch linearly from a quarter of batch_size "
                               "to batch_size over this many steps (0: off)")
    seq_warmup: int = option(0, "grow the training window linearly from 16 tokens to block_size, in steps "
                             "of 16, over this many steps (0: off; text runs only: a task's examples "
                             "have their own lengths)")
    optimizer: str = option("adamw", "adamw everywhere, or muon for the blocks' weight matrices and adamw "
                            "for the rest (embeddings, head, norms, biases)", OPTIMIZERS)
    muon_lr: float = option(0.04, "peak learning rate of muon's matrices (with --optimizer muon)")
    muon_nesterov: bool = option(True, "muon orthogonalises the Nesterov look-ahead of its momentum rather "
                                 "than the momentum itself, as torch.optim.Muon does by default")
    muon_ns_steps: int = option(5, "muon's Newton-Schulz iterations per update (torch.optim.Muon's default "
                                "is 5; fewer are cheaper and less exactly orthogonal)")
    muon_precision: str = option("auto", "precision of muon's Newton-Schulz products: auto takes "
                                 "bfloat16, as torch.optim.Muon does, where the device multiplies it "
                                 "natively (a GPU, a CPU with AVX512-BF16 or AMX) and float32 on a CPU "
                                 "without, where bfloat16 products run about 10x slower; decided when a new "
                                 "run starts and saved in the run's config.json", MUON_PRECISIONS)
    weight_decay: float = option(0.1, "AdamW weight decay, on matrices only (not biases, norms)")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.99, "AdamW beta2")
    grad_clip: float = option(1.0, "clip the global gradient norm to this (0 turns clipping off)")
    eval_interval: int = option(250, "evaluate on the held-out split every this many steps")
    eval_batches: int = option(20, "micro-batches per evaluation")
    seed: int = option(1337, "seed for initialisation, batches and dropout")
    precision: str = option("auto", "matmul precision: auto times a few steps in float32 and in bfloat16 "
                            "when a new run starts (on a CPU with native bfloat16; bfloat16 on a GPU that "
                            "has it) and saves the faster in the run's config.json", PRECISIONS)
    compile: bool = option(False, "wrap the model in torch.compile")
    device: str = option("auto", "cpu, cuda, cuda:N, mps, or auto")
    save_every: float = option(60.0, "also save last.safetensors after this many seconds of training since "
                               "the last save, so a kill loses at most that much (0: at evaluations only)")
    track_heads: bool = option(False, "at every evaluation, score each head for previous-token, duplicate-"
                               "token, induction and first-token attention on repeated random tokens, and "
                               "measure the loss on their repeats, into metrics.csv (plot: gptlab heads RUN "
                               "--history)")
    parallel: str = option("ddp", "under torchrun: ddp replicates the model, fsdp shards weights, "
                           "gradients and optimiser state", PARALLEL)
    checkpoint_format: str = option("auto", "file: one safetensors file per checkpoint, gathered to the main "
                                    "process; sharded: every process writes its own shards into a folder "
                                    "(torch.distributed.checkpoint), read back by any number of processes; "
                                    "auto: sharded under torchrun with --parallel fsdp, a file otherwise",
                                    CHECKPOINT_FORMATS)
    log: tuple[str, ...] = option((), "also send the metrics of every step and evaluation to these: "
                                  "tensorboard (into RUN/tensorboard), wandb (Weights & Biases, into "
                                  "RUN/wandb; WANDB_PROJECT, WANDB_MODE=offline apply); steps.csv and "
                                  "metrics.csv are always written (--log-to is the same option, for "
                                  "torchrun, which takes --log for its own)", LOGS, aliases=("--log-to",))

    def validate(self) -> None:
        owner = "TrainConfig"
        check_positive(
            owner,
            batch_size=self.batch_size,
            grad_accum=self.grad_accum,
            max_steps=self.max_steps,
            lr=self.lr,
            eval_interval=self.eval_interval,
            eval_batches=self.eval_batches,
        )
        check_choice(owner, "precision", self.precision, PRECISIONS)
        check_choice(owner, "parallel", self.parallel, PARALLEL)
        check_choice(owner, "checkpoint_format", self.checkpoint_format, CHECKPOINT_FORMATS)
        check_choice(owner, "optimizer", self.optimizer, OPTIMIZERS)
        check_choice(owner, "muon_precision", self.muon_precision, MUON_PRECISIONS)
        for name in self.log:
            check_choice(owner, "log", name, LOGS)
        if len(set(self.log)) < len(self.log):
            raise ValueError(f"{owner}.log={list(self.log)} names a destination twice: name each once")
        check_positive(owner, muon_lr=self.muon_lr, muon_ns_steps=self.muon_ns_steps)
        check_choice(owner, "schedule", self.schedule, SCHEDULES)
        if not 0.0 <= self.cooldown <= 1.0:
            raise ValueError(f"{owner}.cooldown={self.cooldown} must be in [0, 1]: a fraction of decay_steps")
        if self.decay_steps is not None:
            check_positive(owner, decay_steps=self.decay_steps)
        for name in ("min_lr", "warmup_steps", "weight_decay", "grad_clip", "save_every", "batch_warmup",
                     "seq_warmup"):
            if getattr(self, name) < 0:
                raise ValueError(f"{owner}.{name}={getattr(self, name)} must not be negative")
        if self.min_lr > self.lr:
            raise ValueError(f"{owner}.min_lr={self.min_lr} is above lr={self.lr}: lower min_lr")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{owner}.{name}={getattr(self, name)} must be in [0, 1)")


@dataclass
class Seq2SeqConfig(ModelConfig):
    """An encoder-decoder built from the same blocks: the decoder's fields are ModelConfig's, and the
    encoder copies them with its own depth and without the causal mask. One vocabulary and one
    token embedding serve sources and targets; `block_size` bounds both lengths."""

    n_encoder_layer: int = option(2, "encoder blocks (n_layer counts the decoder's)")
    pad_id: int = option(0, "token id that pads sources and targets to a common length")

    def validate(self) -> None:
        super().validate()
        check_positive("Seq2SeqConfig", n_encoder_layer=self.n_encoder_layer)
        if self.ffn == "none":
            raise ValueError("Seq2SeqConfig.ffn='none': attention-only blocks are offered for the GPT only; "
                             "choose a feed-forward activation such as gelu")
        if not self.causal:
            raise ValueError("Seq2SeqConfig.causal=False: the decoder must stay causal; only the encoder "
                             "is unmasked, and it is by construction")
        for name in ("unet", "logit_softcap", "ngram_embeddings"):
            if getattr(self, name):
                raise ValueError(f"Seq2SeqConfig.{name}={getattr(self, name)!r}: this option is offered for "
                                 "the GPT only; leave it out")
        if not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"Seq2SeqConfig.pad_id={self.pad_id} is outside the vocabulary "
                             f"0..{self.vocab_size - 1}")

    def encoder_config(self) -> ModelConfig:
        """The encoder's blocks: the same options, n_encoder_layer deep, attending in both directions."""
        fields = {name: getattr(self, name) for name in ModelConfig.field_names()}
        return ModelConfig.from_dict({**fields, "n_layer": self.n_encoder_layer, "causal": False})


TASKS = ("reverse", "sort", "add")
DTYPES = ("float32", "bfloat16")  # the precisions a trained model's weights can be held in for inference
QUANTIZATIONS = ("none", "int8")  # weight-only quantisations for inference (gptlab.inference.quantize)


@dataclass
class TaskConfig(Config):
    """A built-in sequence-to-sequence task, generated on the fly (see gptlab.seq2seq.tasks)."""

    task: str = option("reverse", "reverse a string of letters, sort digits, or add two numbers", TASKS)
    min_len: int = option(1, "shortest source: letters or digits (add: digits per number)")
    max_len: int = option(12, "longest source: letters or digits (add: digits per number)")
    eval_examples: int = option(1000, "held-out examples decoded at each evaluation for exact match")

    def validate(self) -> None:
        check_choice("TaskConfig", "task", self.task, TASKS)
        check_positive("TaskConfig", min_len=self.min_len, max_len=self.max_len,
                       eval_examples=self.eval_examples)
        if self.min_len > self.max_len:
            raise ValueError(f"TaskConfig.min_len={self.min_len} is above max_len={self.max_len}: "
                             "lower min_len or raise max_len")


@dataclass
class SamplingConfig(Config):
    """How generation chooses tokens and when it stops (§7.1): the settings of `sample`, `generate`,
    `stream_text`, the seq2seq decoder and the server's requests, validated here and nowhere else."""

    temperature: float = option(1.0, "0 = greedy (always the likeliest token); higher = more random")
    top_k: int | None = option(None, "sample only among the k most likely tokens")
    top_p: float = option(1.0, "sample only among the fewest tokens whose probability reaches P (1: all)")
    max_new_tokens: int = option(300, "stop after this many new tokens")
    stop: tuple[str, ...] = option((), "stop before any of these strings, which are not shown")
    seed: int | None = option(None, "seed of the sampler, for repeatable samples (none: unseeded)")
    logit_bias: dict[int, float] | None = option(
        None, "a JSON object of token id -> number in [-100, 100] added to that token's logit before "
        "sampling (-100 bans it), as OpenAI's logit_bias")

    def validate(self) -> None:
        owner = "SamplingConfig"
        if self.temperature < 0:
            raise ValueError(f"{owner}.temperature={self.temperature} must be >= 0 (0 means greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"{owner}.top_k={self.top_k} must be at least 1 (or None: every token)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{owner}.top_p={self.top_p} must be in (0, 1] (1 keeps every token)")
        if self.max_new_tokens < 0:
            raise ValueError(f"{owner}.max_new_tokens={self.max_new_tokens} must not be negative")
        if not all(self.stop):
            raise ValueError(f"{owner}.stop={list(self.stop)!r}: stop strings must not be empty")
        bias = self.logit_bias or {}
        bad = next(((t, b) for t, b in bias.items() if t < 0 or not -100 <= b <= 100), None)
        if bad is not None:
            raise ValueError(f"{owner}.logit_bias={{{bad[0]}: {bad[1]}}}: token ids must be >= 0 and biases "
                             "in [-100, 100]")

    @property
    def greedy(self) -> bool:
        """Temperature 0 takes the likeliest token, so top-k, top-p and the seed change nothing."""
        return self.temperature == 0


# gptlab sample's, chat's and gptlab.load's own defaults over SamplingConfig's
SAMPLE_DEFAULTS: dict[str, Any] = {"temperature": 0.8, "seed": 1337}
