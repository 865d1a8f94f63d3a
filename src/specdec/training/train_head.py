"""Train an EAGLE or Medusa head on a frozen target: features once, then the head's loss.

1. Features (extract_features): the target reads every training window once
   (a prefill, no generation) and its final-norm hidden states are stored
   with the tokens as safetensors shards. Both heads learn only from these,
   so training never runs the 1.5B target again and a second run reuses them.
2. Loss, as in the papers:
   EAGLE (Li et al. 2024, Section 4.2): smooth L1 between the predicted
   feature f^_{j+1} and the target's f_{j+1}, plus 0.1 x the cross-entropy
   of the head's token distribution against the target's own distribution
   at j+1 (both through the output head); the input features get uniform
   noise U(-0.1, 0.1) so the head copes with its own imperfect predictions
   when drafting autoregressively.
   EAGLE-3 (Li et al. 2025, Section 3): no feature loss. The head is unrolled
   on its own drafts for --ttt-steps steps (training-time test: step s feeds
   step s-1's output feature and greedy token, attending to the target-fed
   keys of its context and to its own chain's earlier drafts; the mask is
   models/heads/eagle3.py: unrolled_mask), and each step's draft distribution is
   pulled towards the target's (KL, over the draft vocabulary). Acceptance-
   aware: step s's loss at a root is weighted by the probability that the
   drafts before it were accepted there, prod_{i<s} sum_x min(p_i, q_i) (the
   acceptance probability of speculative sampling, Leviathan et al. 2022,
   Theorem 3.5), so a deep draft matters as often as it is reached.
   Medusa (Cai et al. 2024, Section 2.1.2): the cross-entropy of head d
   against the token d+1 steps ahead, weighted 0.8^(d-1).
   The MLP speculator (Wertheimer et al. 2024): its stages teacher-forced on
   the true tokens, as the paper's first phase, each pulled towards the
   target's distribution with EAGLE-3's acceptance-weighted KL.
3. Checkpoints: the head's weights as safetensors (what --method eagle and
   medusa load) with the step, losses and held-out accuracies in its
   metadata, and the optimizer beside it (.opt-<token>.pt), so an interrupted
   run resumes where it stopped. The two are written as one unit and resumed
   only as one, whatever moment a kill lands (training/checkpoints.py).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from specdec.engine.step import select_target_features
from specdec.models.atomic_files import atomic_path, write_safetensors
from specdec.models.heads.eagle3 import unrolled_mask
from specdec.models.heads import FrozenVocabulary, HeadConfig, build_head
from specdec.training.checkpoints import resume_point, save_checkpoint


@dataclass
class TrainOptions:
    steps: int = 600
    batch_size: int = 4  # windows per step
    lr: float = 3e-4
    warmup: int = 30
    weight_decay: float = 0.0
    noise: float = 0.1  # EAGLE's U(-noise, noise) on input features
    classification_weight: float = 0.1  # EAGLE's w_cls
    classification_positions: int = 128  # positions per window EAGLE's cross-entropy scores (0 = all)
    medusa_decay: float = 0.8  # Medusa's lambda_d = decay^(d-1)
    medusa_positions: int = 128  # positions per window in Medusa's loss (0 = all)
    ttt_steps: int = 3  # EAGLE-3: unrolled draft steps per root (speculators' default)
    ttt_decay: float = 1.0  # EAGLE-3: step s's loss times decay^s (the acceptance weight already falls with s)
    # HASS's harmonized objective distillation (Zhang et al. 2025, Section 3.1): cross-entropy on the
    # target's top-K tokens alone, beside EAGLE-3's KL, weighted; 0 = off (the paper: K = 10, weight 1).
    topk_distill: int = 0
    topk_weight: float = 1.0
    grad_clip: float = 0.5
    checkpoint_every: int = 100
    heldout_windows: int = 16
    seed: int = 0


# ---- 1. features ----------------------------------------------------------------------------

SHARD = 32  # windows per features file


@torch.inference_mode()
def extract_features(runner, chunks: list[list[int]], out_dir: Path, progress: bool = True,
                     aux_layers: list[int] | None = None) -> list[Path]:
    """Run the target over each window once; shards of {"tokens" [n, T] int32, "features" [n, T, H]},
    plus "aux" [n, T, 3H], the inputs of aux_layers, for EAGLE-3.

    Resumable: a shard already on disk is kept (its windows are the same, given the same corpus options).
    """
    from tqdm.auto import tqdm

    out_dir.mkdir(parents=True, exist_ok=True)
    shards = []
    read_layers = (*aux_layers, runner.decoder.config.num_layers) if aux_layers else ()
    bar = tqdm(total=len(chunks), desc="target features", unit="window", disable=not progress, file=sys.stderr)
    for first in range(0, len(chunks), SHARD):
        path = out_dir / f"shard-{first // SHARD:05d}.safetensors"
        batch = chunks[first: first + SHARD]
        shards.append(path)
        if path.is_file():
            bar.update(len(batch))
            continue
        features, aux = [], []
        for window in batch:
            ids = torch.tensor([window], device=runner.device)
            positions = torch.arange(len(window), device=runner.device)[None]
            runner.reset()
            # Chosen before every read: an engine that ran an EAGLE-3 head on this runner left its layers selected.
            select_target_features(runner, read_layers)
            try:
                hidden = runner.forward(ids, positions, last_n_logits=1).hidden[0].to(torch.bfloat16).cpu()
            finally:
                select_target_features(runner, ())
            size = hidden.shape[-1] // (len(aux_layers or ()) + 1)
            if aux_layers:  # the inner layers' inputs and, last, the final features: one read
                aux.append(hidden[:, :-size])
            features.append(hidden[:, -size:])
            bar.update(1)
        tensors = {"tokens": torch.tensor(batch, dtype=torch.int32), "features": torch.stack(features)}
        if aux:
            tensors["aux"] = torch.stack(aux)
        with atomic_path(path) as partial:  # a shard on disk is whole: the next run keeps it
            write_safetensors(partial, tensors)
    bar.close()
    runner.reset()
    return shards


def load_features(shards: list[Path]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(tokens [N, T] int64, features [N, T, H] bf16, aux [N, T, 3H] bf16 or None) from all shards."""
    from safetensors.torch import load_file

    loaded = [load_file(str(path)) for path in shards]
    aux = torch.cat([part["aux"] for part in loaded]) if all("aux" in part for part in loaded) else None
    return (torch.cat([part["tokens"] for part in loaded]).long(),
            torch.cat([part["features"] for part in loaded]), aux)


# ---- 2. losses ------------------------------------------------------------------------------

def reduced_ids(tokens: torch.Tensor, vocab: FrozenVocabulary) -> torch.Tensor:
    """Target ids -> positions in the head's vocabulary; -100 (ignored) for ids outside it."""
    lookup = torch.full((vocab.embedding.shape[0],), -100, dtype=torch.int64, device=tokens.device)
    lookup[vocab.vocab_ids] = torch.arange(len(vocab.vocab_ids), device=tokens.device)
    return lookup[tokens]


def eagle_loss(head, vocab: FrozenVocabulary, tokens: torch.Tensor, features: torch.Tensor,
               options: TrainOptions, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """tokens [B, T], features [B, T, H] -> (loss, {"regression", "classification", "top1"}).

    Noise and the scored positions come from `generator` (None: the global one).
    """
    inputs = features[:, :-1].float()  # f_j
    if options.noise:
        inputs = inputs + (torch.rand(inputs.shape, generator=generator, device=inputs.device) * 2 - 1) * options.noise
    positions = torch.arange(inputs.shape[1], device=tokens.device)[None].expand(tokens.shape[0], -1)
    predicted = head(inputs, vocab.embed(tokens[:, 1:]).float(), positions)  # f^_{j+1} [B, T-1, H]
    wanted = features[:, 1:].float()  # f_{j+1}
    regression = nn.functional.smooth_l1_loss(predicted, wanted)
    # The output head is the costliest matmul here: score a subsample of positions (all with 0).
    count = predicted.shape[1]
    keep = min(options.classification_positions or count, count)
    picks = torch.randperm(count, generator=generator, device=tokens.device)[:keep]
    head_logits = vocab.logits(predicted[:, picks].float())
    with torch.no_grad():
        target_probs = torch.softmax(vocab.logits(wanted[:, picks]), dim=-1)  # the target's own next-token law
    classification = -(target_probs * torch.log_softmax(head_logits, dim=-1)).sum(-1).mean()
    loss = regression + options.classification_weight * classification
    with torch.no_grad():
        top1 = (head_logits.argmax(-1) == target_probs.argmax(-1)).float().mean()
    return loss, {"regression": float(regression.detach()), "classification": float(classification.detach()),
                  "top1": float(top1)}


def unroll_eagle3(head, vocab: FrozenVocabulary, tokens: torch.Tensor, features: torch.Tensor,
                  aux: torch.Tensor, steps: int, roots: torch.Tensor | None = None):
    """Training-time test: yields, for s = 0..steps-1, (s, draft logits [B, P, N], target log-probs
    [B, P, N]) at the roots j (default: every root with a target at every step). The step-s
    draft at root j is the token s + 2 after t_j; its target is the target's distribution at
    position j + 1 + s. Step s feeds step s-1's output feature and greedy token (never the true
    one) and attends as drafting will (models/heads/eagle3.py: unrolled_mask): to the target-fed keys
    of the context up to j, and to its own chain's earlier drafts.

    Only step 0 runs at every position (its keys are everyone's context); deeper steps run at
    the P roots alone, and the output matrix (the costliest matmul) scores those P.
    """
    length = tokens.shape[1] - 1  # positions j with a next token t_{j+1}
    device = tokens.device
    if roots is None:
        roots = torch.arange(length - steps + 1, device=device)
    hidden = head.read_target(aux[:, :-1].float())  # [B, n, H]
    next_tokens = tokens[:, 1:]  # t_{j+1}
    positions = torch.arange(length, device=device)[None].expand(tokens.shape[0], -1)
    config = head.config
    gqa = config.num_heads != config.num_kv_heads
    context_keys = context_values = None
    own_keys, own_values = [], []
    for step in range(steps):
        query, key, value, residual = head.project(hidden, vocab.embed(next_tokens).float(), positions + step)
        if step == 0:  # every position: causal over the context
            context_keys, context_values = key, value
            attended = nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=gqa)
            out = head.finish(attended, residual)[:, roots]  # [B, P, H]
        else:  # the P roots: their context up to j, and their own earlier drafts (the diagonal)
            own_keys.append(key)
            own_values.append(value)
            mask = unrolled_mask(roots, length, step + 1)
            attended = nn.functional.scaled_dot_product_attention(
                query, torch.cat([context_keys, *own_keys], dim=2), torch.cat([context_values, *own_values], dim=2),
                attn_mask=mask, enable_gqa=gqa)
            out = head.finish(attended, residual)
        logits = vocab.logits(head.to_output(out))  # [B, P, N]
        with torch.no_grad():
            target_logp = torch.log_softmax(vocab.logits(features[:, roots + 1 + step].float()), dim=-1)
        yield step, logits, target_logp
        hidden = out
        next_tokens = vocab.to_target_ids(logits.detach().argmax(-1))  # the head's own greedy draft
        positions = roots[None].expand(tokens.shape[0], -1)  # step s runs at root j's position j + s


def unroll_mlp_speculator(head, vocab: FrozenVocabulary, tokens: torch.Tensor, features: torch.Tensor,
                          roots: torch.Tensor):
    """Teacher-forced, as fms-extras' first training phase: yields, for each stage i, (i, draft logits
    [B, P, N], target log-probs [B, P, N]) at the roots j. Stage i reads the true t_{j+1+i} and
    predicts t_{j+2+i}, whose law is the target's at position j + 1 + i."""
    state = features[:, roots].float()  # f_j
    for index in range(head.config.mlp_stages):
        state = head.stage(index, state, vocab.embed(tokens[:, roots + 1 + index]).float())
        logits = head.output(state).float()
        with torch.no_grad():
            target_logp = torch.log_softmax(vocab.logits(features[:, roots + 1 + index].float()), dim=-1)
        yield index, logits, target_logp


def _distillation(unrolled, reached: torch.Tensor, options: TrainOptions) -> tuple[torch.Tensor, dict]:
    """The chained heads' loss over (step, draft logits, target log-probs) [B, P, N]: each step's KL to
    the target (plus HASS's top-K term), weighted by the chance the drafts before it were accepted;
    reached [B, P] starts at ones. Returns (loss, {"kl_s", "top1_s"})."""
    loss = torch.zeros((), device=reached.device)
    stats = {}
    for step, logits, target_logp in unrolled:
        draft_logp = torch.log_softmax(logits, dim=-1)  # [B, P, N]
        kl = (target_logp.exp() * (target_logp - draft_logp)).sum(-1)  # [B, P]
        step_loss = kl
        if options.topk_distill:  # what the target ranks first is what acceptance needs the draft to rank first
            top = target_logp.topk(options.topk_distill, dim=-1)
            step_loss = step_loss - options.topk_weight * (top.values.exp() * draft_logp.gather(-1, top.indices)).sum(-1)
        loss = loss + options.ttt_decay ** step * (reached * step_loss).mean()
        with torch.no_grad():
            reached = reached * torch.minimum(draft_logp.exp(), target_logp.exp()).sum(-1)  # x sum_x min(p, q)
            stats[f"kl_{step + 1}"] = float(kl.mean())
            stats[f"top1_{step + 1}"] = float((draft_logp.argmax(-1) == target_logp.argmax(-1)).float().mean())
    return loss, stats


def _roots(tokens: torch.Tensor, depth: int, options: TrainOptions, generator: torch.Generator | None
           ) -> torch.Tensor:
    """options.classification_positions roots per window (0: all) with a target at every one of depth steps."""
    valid = tokens.shape[1] - depth
    keep = min(options.classification_positions or valid, valid)
    return torch.randperm(valid, generator=generator, device=tokens.device)[:keep].sort().values


def eagle3_loss(head, vocab: FrozenVocabulary, tokens: torch.Tensor, features: torch.Tensor, aux: torch.Tensor,
                options: TrainOptions, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """tokens [B, T], features [B, T, H], aux [B, T, 3H] -> (loss, {"kl_s", "top1_s"} per unrolled step)."""
    roots = _roots(tokens, options.ttt_steps, options, generator)
    reached = torch.ones(tokens.shape[0], len(roots), device=tokens.device)  # P(drafts before step s accepted)
    return _distillation(unroll_eagle3(head, vocab, tokens, features, aux, options.ttt_steps, roots), reached, options)


def mlp_speculator_loss(head, vocab: FrozenVocabulary, tokens: torch.Tensor, features: torch.Tensor,
                        options: TrainOptions, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """tokens [B, T], features [B, T, H] -> (loss, {"kl_s", "top1_s"} per stage): EAGLE-3's distillation
    (and HASS's top-K term) on the teacher-forced stages."""
    roots = _roots(tokens, head.config.mlp_stages, options, generator)
    reached = torch.ones(tokens.shape[0], len(roots), device=tokens.device)
    return _distillation(unroll_mlp_speculator(head, vocab, tokens, features, roots), reached, options)


def medusa_loss(heads, vocab: FrozenVocabulary, tokens: torch.Tensor, features: torch.Tensor,
                options: TrainOptions, generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict]:
    """Head d (1-based) on f_j against t_{j+1+d}; returns (loss, {"ce_d", "top1_d"}).

    Each head runs the full output head, m times EAGLE's one; positions are
    subsampled (options.medusa_positions per window, the same for every head)
    to keep that affordable on a CPU: neighbouring positions teach much the same.
    """
    labels = reduced_ids(tokens, vocab)
    num_heads = heads.config.num_medusa_heads
    usable = tokens.shape[1] - num_heads - 1  # positions j with a label for every head
    keep = min(options.medusa_positions or usable, usable)
    picks = torch.randperm(usable, generator=generator, device=tokens.device)[:keep].sort().values  # [P]
    per_head = heads(features[:, picks].float())  # [B, P, m, H]
    loss = torch.zeros((), device=tokens.device)
    stats = {}
    for index in range(num_heads):
        ahead = index + 2  # head 1 predicts t_{j+2}
        logits = vocab.logits(per_head[:, :, index])  # [B, P, N]
        wanted = labels[:, picks + ahead]
        ce = nn.functional.cross_entropy(logits.flatten(0, 1), wanted.flatten(), ignore_index=-100)
        loss = loss + options.medusa_decay ** index * ce
        with torch.no_grad():
            valid = wanted >= 0
            stats[f"top1_{index + 1}"] = float(((logits.argmax(-1) == wanted) & valid).sum() / valid.sum().clamp_min(1))
        stats[f"ce_{index + 1}"] = float(ce.detach())
    return loss, stats


@torch.no_grad()
def rank_accuracies(kind: str, head, vocab: FrozenVocabulary, tokens: torch.Tensor, features: torch.Tensor,
                    topk: int = 8, aux: torch.Tensor | None = None, ttt_steps: int = 3) -> list[list[float]]:
    """Held-out: how often the target's choice is the head's i-th choice, per depth.

    EAGLE has one depth (the target's top-1 at j+2 from f_j, teacher-forced); EAGLE-3 one per
    unrolled step, each fed the head's own earlier drafts, as at inference; Medusa one per head;
    the MLP speculator one per stage, fed the true tokens (what counts once the drafts before it
    were accepted). These size Medusa's static tree (proposers/heads.py: medusa_tree).
    """
    if kind == "eagle":
        positions = torch.arange(tokens.shape[1] - 1)[None].expand(tokens.shape[0], -1)
        predicted = head(features[:, :-1].float(), vocab.embed(tokens[:, 1:]).float(), positions)
        logits = [vocab.logits(predicted)]
        wanted = [vocab.logits(features[:, 1:].float()).argmax(-1)]
    elif kind in ("eagle3", "mlp-speculator"):  # two windows at a time: each step's logits over every root are large
        depth = ttt_steps if kind == "eagle3" else head.config.mlp_stages
        hits, counts = torch.zeros(depth, topk), torch.zeros(depth)
        for first in range(0, tokens.shape[0], 2):
            part = slice(first, first + 2)
            unrolled = unroll_eagle3(head, vocab, tokens[part], features[part], aux[part], ttt_steps) \
                if kind == "eagle3" else \
                unroll_mlp_speculator(head, vocab, tokens[part], features[part],
                                      torch.arange(tokens.shape[1] - depth, device=tokens.device))
            for step, logits, target_logp in unrolled:
                ranked = torch.topk(logits, topk, dim=-1).indices
                hits[step] += (ranked == target_logp.argmax(-1)[..., None]).flatten(0, 1).sum(0).cpu()
                counts[step] += target_logp.shape[0] * target_logp.shape[1]
        return [[round(float(hits[s, i] / counts[s]), 4) for i in range(topk)] for s in range(depth)]
    else:
        labels = reduced_ids(tokens, vocab)
        per_head = head(features.float())  # [B, T, m, H]
        logits = [vocab.logits(per_head[:, :-(d + 2), d]) for d in range(per_head.shape[2])]
        wanted = [labels[:, d + 2:] for d in range(per_head.shape[2])]
    accuracies = []
    for depth_logits, depth_wanted in zip(logits, wanted):
        ranked = torch.topk(depth_logits, topk, dim=-1).indices  # [B, T', topk]
        hits = ranked == depth_wanted[..., None]
        valid = (depth_wanted >= 0).sum().clamp_min(1)
        accuracies.append([round(float(hits[..., i].sum() / valid), 4) for i in range(topk)])
    return accuracies


# ---- 3. the loop ----------------------------------------------------------------------------

def _lr_at(step: int, options: TrainOptions) -> float:
    """Linear warmup, then cosine decay to a tenth."""
    if step < options.warmup:
        return options.lr * (step + 1) / options.warmup
    progress = (step - options.warmup) / max(1, options.steps - options.warmup)
    return options.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_head(config: HeadConfig, vocab: FrozenVocabulary, tokens: torch.Tensor, features: torch.Tensor,
               checkpoint: Path, options: TrainOptions, *, device: torch.device, progress: bool = True,
               log=print, aux: torch.Tensor | None = None) -> dict:
    """Train (or resume) a head; returns the final checkpoint's extra metadata.
    aux [N, T, 3H]: the target's inner-layer features, which an EAGLE-3 head reads."""
    if config.kind == "eagle3" and aux is None:
        raise ValueError("an eagle3 head trains on the target's inner-layer features (aux); none were extracted")
    from tqdm.auto import tqdm

    torch.manual_seed(options.seed)
    heldout = min(options.heldout_windows, max(1, tokens.shape[0] // 10))
    train_tokens, train_features = tokens[heldout:], features[heldout:]
    test_tokens, test_features = tokens[:heldout].to(device), features[:heldout].to(device)
    train_aux = aux[heldout:] if aux is not None else None
    test_aux = aux[:heldout].to(device) if aux is not None else None
    if train_tokens.shape[0] == 0:
        raise ValueError("not enough training windows: raise --max-tokens or lower --seq-len")

    head = build_head(config)
    if config.kind == "mlp-speculator":
        head.start_from(vocab.output_weight)
    head = head.to(device)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=options.lr,
                                  weight_decay=options.weight_decay, betas=(0.9, 0.95))
    start, history = 0, []
    previous = resume_point(checkpoint, device)
    same_run = previous is not None and previous.head.config.kind == config.kind \
        and previous.head.extra.get("steps_total") == options.steps
    if same_run:
        head.load_state_dict(previous.head.module.state_dict())
        start, history = int(previous.head.extra.get("step", 0)), list(previous.head.extra.get("history", []))
        if previous.optimizer_state is not None:
            optimizer.load_state_dict(previous.optimizer_state)
            log(f"resuming {checkpoint.name} at step {start}/{options.steps}")
        else:
            log(f"resuming {checkpoint.name} at step {start}/{options.steps} with a fresh optimizer, as "
                f"{previous.refused}; the run will not repeat an uninterrupted one exactly")

    # Batches and noise depend only on (seed, step), so a resumed run repeats an uninterrupted one.
    order = torch.randperm(train_tokens.shape[0], generator=torch.Generator().manual_seed(options.seed))
    autocast = device.type == "cuda" or _cpu_bf16()
    started = time.perf_counter()
    bar = tqdm(range(start, options.steps), desc=f"train {config.kind}", initial=start, total=options.steps,
               disable=not progress, file=sys.stderr)
    extra: dict = {}
    for step in bar:
        picks = [int(order[(step * options.batch_size + i) % len(order)]) for i in range(options.batch_size)]
        batch_tokens = train_tokens[picks].to(device)
        batch_features = train_features[picks].to(device)
        batch_aux = train_aux[picks].to(device) if train_aux is not None else None
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, options)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            randomness = torch.Generator(device=device).manual_seed(options.seed * 1_000_003 + step)
            loss, stats = _loss(config.kind, head, vocab, batch_tokens, batch_features, batch_aux, options, randomness)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        nn.utils.clip_grad_norm_(head.parameters(), options.grad_clip)
        optimizer.step()
        history.append({"step": step + 1, "loss": round(float(loss.detach()), 4), **{k: round(v, 4) for k, v in stats.items()}})
        bar.set_postfix(loss=f"{history[-1]['loss']:.3f}", **{k: f"{v:.3f}" for k, v in stats.items() if "top1" in k})
        done = step + 1
        if done % options.checkpoint_every == 0 or done == options.steps:
            head.eval()
            accuracies = rank_accuracies(config.kind, head, vocab, test_tokens, test_features, aux=test_aux,
                                         ttt_steps=options.ttt_steps)
            head.train()
            extra = {"step": done, "steps_total": options.steps, "history": history[-200:],
                     "heldout_accuracies": accuracies, "train_seconds": round(time.perf_counter() - started, 1),
                     "windows": int(tokens.shape[0]), "seq_len": int(tokens.shape[1])}
            final = HeadConfig(**{**config.__dict__, "accuracies": accuracies})
            save_checkpoint(checkpoint, head, final, vocab.vocab_ids, extra, optimizer.state_dict())
            log(f"step {done}: loss {history[-1]['loss']:.4f}, held-out top-1 by depth "
                f"{', '.join(f'{row[0]:.2f}' for row in accuracies)} -> {checkpoint}")
    bar.close()
    return extra


def _loss(kind: str, head, vocab: FrozenVocabulary, tokens: torch.Tensor, features: torch.Tensor,
          aux: torch.Tensor | None, options: TrainOptions, generator: torch.Generator) -> tuple[torch.Tensor, dict]:
    """The head kind's paper loss on one batch (module docstring)."""
    if kind == "eagle":
        return eagle_loss(head, vocab, tokens, features, options, generator)
    if kind == "eagle3":
        return eagle3_loss(head, vocab, tokens, features, aux, options, generator)
    if kind == "mlp-speculator":
        return mlp_speculator_loss(head, vocab, tokens, features, options, generator)
    return medusa_loss(head, vocab, tokens, features, options, generator)


def _cpu_bf16() -> bool:
    from specdec.models.loader import cpu_has_fast_bf16

    return cpu_has_fast_bf16()
