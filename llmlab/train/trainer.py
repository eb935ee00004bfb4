"""The training loop of the shipped model: next-token cross-entropy on packed token windows, AdamW, cosine LR.

Pipeline (`prepare_data` then `train`):

1. corpus (`corpus.py`) -> train / held-out documents;
2. byte-level BPE tokenizer trained on the train documents (`tokenizer.py`);
3. each split packed into one token stream `<eot> doc <eot> doc ... <eot>` (the separator doubles as BOS/EOS);
4. each step draws `batch_size` windows of `seq_len + 1` tokens at random offsets of the train stream (seeded
   `torch.Generator`), input = window[:-1], target = window[1:] (nanoGPT's `get_batch`); held-out loss is the mean
   over the held-out stream cut into consecutive non-overlapping windows, always the same ones;
5. AdamW (decoupled weight decay on matrices only; Loshchilov & Hutter 2019, https://arxiv.org/abs/1711.05101),
   linear warmup then cosine decay to `min_lr_ratio * lr`, gradient clipping at 1.0, bf16 autocast on CUDA with
   fp32 master weights, TF32 matmuls, fused AdamW;
6. early stopping: the held-out loss is measured every `eval_every` steps, the best weights are kept, and training
   stops after `patience` evaluations without improvement. The corpus is well under a million tokens, so a 7.7M
   parameter model memorises it within a few dozen epochs; the guard keeps the best-generalising weights.

How the defaults were picked (one H200, Python 3.12.3: 555k train / 26k held-out tokens; held-out loss in nats,
best of each run): batch 32 x 1024, lr 2e-3, 8 / 16 / 32 epochs -> 5.71 / 5.11 / 4.66 (still improving, but
~900k tokens/s makes steps, not tokens, the scarce thing); lr 4e-3 no better, lr 1e-3 better (4.56 at 32 epochs);
batch 16, lr 1e-3 -> 4.50; batch 8, lr 1e-3 -> 4.45-4.48, best after ~800 steps (~11 epochs), then the held-out
loss rises while the train loss keeps falling (memorisation), and early stopping ends the run after ~30 s of
training. Weight decay 0.5 instead of 0.1 changed nothing; lr 5e-4 / 7e-4 were worse. Differences under ~0.05
are within seed noise (the held-out split is 17 documents).

Training stops at `steps` or at `time_budget_s` seconds, whichever first. The LR schedule runs on
`progress = max(step / steps, elapsed / time_budget_s)`, so the learning rate has decayed whichever limit ends the
run (with the time limit the run is no longer bit-reproducible; it is the safety net, not the plan).

The model is `llmlab.model.Transformer` run with `kv_cache=None`: training is one causal forward over the window.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..model import Transformer
from .corpus import EOT, CorpusStats, Document, build_corpus
from .tokenizer import VOCAB_SIZE, train_tokenizer


@dataclass
class TrainConfig:
    """The recipe. Defaults are the shipped model's; `smoke()` shrinks everything for a CPU test."""

    device: str = "auto"  # "auto" = cuda if available, else cpu
    steps: int | None = None  # optimizer steps; None: from `epochs`
    epochs: float = 32.0  # passes over the train tokens (used when steps is None); early stopping ends sooner
    time_budget_s: float = 300.0  # wall-clock cap on the training loop (not counting data preparation)
    batch_size: int = 8  # windows per step: small, because the corpus is small and steps matter more than tokens
    seq_len: int = 1024  # tokens per window
    lr: float = 1e-3  # peak learning rate
    min_lr_ratio: float = 0.1  # final LR = min_lr_ratio * lr
    warmup_steps: int = 50
    weight_decay: float = 0.1  # on 2-D weights only (not norms)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0  # max global gradient L2 norm
    eval_every: int = 25  # steps between held-out evaluations
    patience: int = 6  # evaluations without improvement before stopping
    log_every: int = 25  # steps between progress lines (evaluation steps always print one)
    seed: int = 1337
    compile: bool = False  # torch.compile the model (faster on GPU after a warm-up; off = no compile risk)
    val_fraction: float = 0.03
    vocab_size: int = VOCAB_SIZE
    # model shape (the shipped defaults; vocab size and bos/eos come from the tokenizer)
    dim: int = 256
    n_layers: int = 8
    n_heads: int = 8
    n_kv_heads: int = 2
    intermediate_size: int = 704
    max_seq_len: int = 1024
    name: str = "pydoc-llama"
    # corpus limits (smoke test only)
    max_topics: int | None = None
    max_modules: int | None = None

    @classmethod
    def smoke(cls, **overrides) -> "TrainConfig":
        """A tiny model on a slice of the corpus: runs in seconds on a CPU; tests the plumbing, not the quality."""
        params = dict(
            device="cpu", steps=30, time_budget_s=60.0, batch_size=8, seq_len=64, lr=3e-3, warmup_steps=5,
            eval_every=10, patience=100, log_every=10, vocab_size=384, dim=64, n_layers=2, n_heads=4,
            n_kv_heads=2, intermediate_size=172, max_seq_len=128, name="pydoc-llama-smoke", max_topics=6,
            max_modules=12, val_fraction=0.3,
        )
        params.update(overrides)
        return cls(**params)

    def model_config(self, eot_id: int) -> ModelConfig:
        return ModelConfig(
            vocab_size=self.vocab_size, dim=self.dim, n_layers=self.n_layers, n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads, intermediate_size=self.intermediate_size, max_seq_len=self.max_seq_len,
            tie_embeddings=True, rope_theta=10000.0, norm_eps=1e-5, bos_token_id=eot_id, eos_token_id=eot_id,
            name=self.name,
        )

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Data:
    """Everything `train` needs, built once by `prepare_data`."""

    train_docs: list[Document]
    val_docs: list[Document]
    stats: CorpusStats
    tokenizer: object  # tokenizers.Tokenizer
    eot_id: int
    train_tokens: torch.Tensor  # (N_train,) int64: <eot> doc <eot> doc ... <eot>
    val_tokens: torch.Tensor  # (N_val,) int64, same layout
    corpus_s: float  # seconds to build the corpus
    tokenizer_s: float  # seconds to train the tokenizer
    encode_s: float  # seconds to encode both splits


def pack(tokenizer, docs: list[Document], eot_id: int) -> torch.Tensor:
    """Encode documents and join them as one (N,) int64 stream: <eot> d1 <eot> d2 ... <eot>."""
    encoded = tokenizer.encode_batch([d.text for d in docs], add_special_tokens=False)
    ids: list[int] = []
    for e in encoded:
        ids.append(eot_id)
        ids.extend(e.ids)
    ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.int64)


def prepare_data(cfg: TrainConfig, log=print) -> Data:
    """Corpus -> tokenizer (trained on the train split only) -> packed token streams, with timings.

    Raises:
        ValueError: the train or the held-out split is empty.
    """
    t0 = time.perf_counter()
    train_docs, val_docs, stats = build_corpus(cfg.val_fraction, cfg.max_modules, cfg.max_topics)
    t1 = time.perf_counter()
    if not val_docs or not train_docs:
        raise ValueError(f"the split has {len(train_docs)} train and {len(val_docs)} held-out documents; both must "
                         f"be non-empty (raise val_fraction={cfg.val_fraction} or use more documents)")
    log(f"corpus: Python {stats.python_version}, {stats.n_documents} documents ({stats.n_topics} topics, "
        f"{stats.n_modules} modules, {stats.n_docstrings} docstrings), {stats.chars:,} chars, "
        f"sha256 {stats.sha256[:16]}..., held out {stats.n_val_documents} documents  [{t1 - t0:.1f} s]")
    tok = train_tokenizer((d.text for d in train_docs), vocab_size=cfg.vocab_size)
    eot_id = tok.token_to_id(EOT)
    t2 = time.perf_counter()
    log(f"tokenizer: byte-level BPE, vocab {tok.get_vocab_size()}, {EOT} = {eot_id}  [{t2 - t1:.1f} s]")
    train_tokens, val_tokens = pack(tok, train_docs, eot_id), pack(tok, val_docs, eot_id)
    t3 = time.perf_counter()
    log(f"tokens: train {len(train_tokens):,}, held-out {len(val_tokens):,} "
        f"({stats.chars / (len(train_tokens) + len(val_tokens)):.2f} chars/token)  [{t3 - t2:.1f} s]")
    return Data(train_docs, val_docs, stats, tok, eot_id, train_tokens, val_tokens, t1 - t0, t2 - t1, t3 - t2)


# -- batches, schedule, evaluation ---------------------------------------------------------------------------
def get_batch(stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator):
    """Random windows of the stream -> x, y: (B, T) int64 on the stream's device, y = x shifted left by one.

    Raises:
        ValueError: the stream is shorter than seq_len + 1 tokens.
    """
    n_starts = len(stream) - seq_len
    if n_starts < 1:
        raise ValueError(f"the token stream ({len(stream)} tokens) is shorter than seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, n_starts, (batch_size,), generator=gen).to(stream.device)  # (B,)
    idx = starts[:, None] + torch.arange(seq_len + 1, device=stream.device)  # (B, T+1)
    window = stream[idx]
    return window[:, :-1], window[:, 1:]


def eval_windows(stream: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The held-out stream cut into consecutive windows -> x, y: (N, T), T = min(seq_len, len - 1); tail dropped."""
    T = min(seq_len, len(stream) - 1)
    n = (len(stream) - 1) // T
    x = stream[: n * T].view(n, T)
    y = stream[1 : n * T + 1].view(n, T)
    return x, y


def lr_at(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warmup over warmup_steps, times cosine decay from lr to min_lr_ratio * lr over progress in [0, 1]."""
    warm = min(1.0, (step + 1) / max(1, cfg.warmup_steps))
    p = min(1.0, max(0.0, progress))
    decay = cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p))
    return cfg.lr * warm * decay


def autocast(device: torch.device):
    """bf16 autocast on CUDA (fp32 weights, bf16 matmuls); a no-op elsewhere (CPU trains in fp32)."""
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")


@torch.no_grad()
def evaluate(model, x: torch.Tensor, y: torch.Tensor, batch_size: int, amp: bool = True) -> float:
    """Mean next-token cross-entropy (nats/token) over windows x, y: (N, T) on the model's device.

    amp: bf16 autocast on CUDA (as in training); False evaluates in the weights' own dtype.
    """
    was_training = model.training
    model.eval()
    total, count = torch.zeros((), device=x.device, dtype=torch.float64), 0
    for i in range(0, len(x), batch_size):
        xb, yb = x[i : i + batch_size], y[i : i + batch_size]
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp and x.device.type == "cuda"):
            logits = model(xb)  # (b, T, V)
        total += F.cross_entropy(logits.float().flatten(0, 1), yb.flatten(), reduction="sum").double()
        count += yb.numel()
    model.train(was_training)
    return (total / count).item()


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (embeddings, projections), none on vectors (RMSNorm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]  # the tied matrix appears once
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]


def resolve_device(name: str) -> torch.device:
    """'auto' -> cuda if available, else cpu; otherwise as `llmlab.engine.pick_device` (ValueError for a name
    that is not a device, or 'cuda' without a CUDA GPU)."""
    from ..engine import pick_device

    return pick_device(None if name == "auto" else name)


# -- the loop -----------------------------------------------------------------------------------------------
@dataclass
class TrainResult:
    model: Transformer  # holds the BEST weights (lowest held-out loss) when train() returns
    history: list[dict] = field(default_factory=list)  # one row per evaluation
    best_step: int = 0
    best_val_loss: float = float("inf")
    steps_done: int = 0
    planned_steps: int = 0
    tokens_seen: int = 0
    train_s: float = 0.0  # wall seconds of the loop, evaluations included
    stop_reason: str = ""
    device_name: str = ""
    n_params: int = 0


def train(cfg: TrainConfig, data: Data, log=print) -> TrainResult:
    """Train a fresh `Transformer` on `data` following `cfg`; returns the best weights and the loss history.

    Raises:
        ValueError: a stream too short for seq_len (see `get_batch`).
    """
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls (outside autocast) on tensor cores
        torch.backends.cudnn.allow_tf32 = True
    mcfg = cfg.model_config(data.eot_id)
    model = Transformer(mcfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name(device)
    else:
        device_name = f"cpu ({torch.get_num_threads()} threads)"
    fwd = torch.compile(model) if cfg.compile else model

    train_stream = data.train_tokens.to(device)
    vx, vy = (t.to(device) for t in eval_windows(data.val_tokens, cfg.seq_len))
    tokens_per_step = cfg.batch_size * cfg.seq_len
    steps = cfg.steps or max(1, math.ceil(cfg.epochs * len(data.train_tokens) / tokens_per_step))
    log(f"model: {n_params:,} parameters ({mcfg.n_layers} layers, dim {mcfg.dim}, {mcfg.n_heads} heads / "
        f"{mcfg.n_kv_heads} KV heads) on {device_name}; {steps} steps x {tokens_per_step:,} tokens "
        f"= {steps * tokens_per_step / len(data.train_tokens):.1f} epochs, budget {cfg.time_budget_s:.0f} s; "
        f"held-out: {len(vx)} windows of {vx.shape[1]}")

    fused = device.type == "cuda"
    opt = torch.optim.AdamW(param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas, fused=fused)
    gen = torch.Generator().manual_seed(cfg.seed)
    res = TrainResult(model=model, planned_steps=steps, device_name=device_name, n_params=n_params)
    best_state, bad_evals = None, 0
    loss_sum, loss_n = torch.zeros((), device=device), 0
    model.train()
    t0 = t_log = time.perf_counter()
    tokens_at_log = 0
    res.stop_reason = "steps"
    for step in range(steps):
        elapsed = time.perf_counter() - t0
        lr = lr_at(cfg, step, max(step / steps, elapsed / cfg.time_budget_s))
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = get_batch(train_stream, cfg.batch_size, cfg.seq_len, gen)
        with autocast(device):
            logits = fwd(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        loss_sum += loss.detach()
        loss_n += 1
        res.steps_done = step + 1
        res.tokens_seen += tokens_per_step

        out_of_time = time.perf_counter() - t0 > cfg.time_budget_s
        last = step + 1 == steps or out_of_time
        if (step + 1) % cfg.eval_every == 0 or last:
            val = evaluate(fwd, vx, vy, cfg.batch_size)
            train_loss = (loss_sum / loss_n).item()
            loss_sum.zero_()
            loss_n = 0
            res.history.append({"step": step + 1, "tokens": res.tokens_seen, "train_loss": round(train_loss, 4),
                                "val_loss": round(val, 4), "lr": float(f"{lr:.3g}"),
                                "elapsed_s": round(time.perf_counter() - t0, 2)})
            improved = val < res.best_val_loss - 1e-4
            if improved:
                res.best_val_loss, res.best_step, bad_evals = val, step + 1, 0
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            else:
                bad_evals += 1
            now = time.perf_counter()
            tps = (res.tokens_seen - tokens_at_log) / (now - t_log)
            t_log, tokens_at_log = now, res.tokens_seen
            log(f"step {step + 1:5d}/{steps} | train {train_loss:.4f} | val {val:.4f}{' *' if improved else '  '} "
                f"| lr {lr:.2e} | {tps:,.0f} tok/s | {now - t0:6.1f} s")
            if out_of_time:
                res.stop_reason = "time budget"
                break
            if bad_evals >= cfg.patience:
                res.stop_reason = f"early stop: no held-out improvement in {cfg.patience} evaluations"
                break
        elif (step + 1) % cfg.log_every == 0:
            now = time.perf_counter()
            tps = (res.tokens_seen - tokens_at_log) / (now - t_log)
            t_log, tokens_at_log = now, res.tokens_seen
            log(f"step {step + 1:5d}/{steps} | train {loss.item():.4f} |             | lr {lr:.2e} "
                f"| {tps:,.0f} tok/s | {now - t0:6.1f} s")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    res.train_s = time.perf_counter() - t0
    if best_state is not None:
        model.load_state_dict(best_state)
    log(f"done: {res.steps_done} steps, {res.tokens_seen:,} tokens in {res.train_s:.1f} s "
        f"({res.tokens_seen / res.train_s:,.0f} tok/s; {res.stop_reason}); "
        f"best held-out loss {res.best_val_loss:.4f} at step {res.best_step}")
    return res
