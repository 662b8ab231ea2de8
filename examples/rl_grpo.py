"""GRPO-style RL with verifiable rewards on a toy task, with a stale-logprob bug injected at a known step.

The policy (a tiny byte-level GPT, briefly pre-trained on "a+b=c") answers "a+b=" prompts; a
reward of 1 is given when the answer is the right sum. Advantages are group-normalised (GRPO),
and the loss is the token-level importance-weighted surrogate ``-ratio * advantage`` with a FIXED
normaliser (the batch's response-token count), so ``loss_fn(mask)`` restricted to any subset of
tokens has the sum of their gradients — what the localizer needs.

At ``--inject-step`` one sampled response gets a stale behaviour log-prob (``old_logp - 6``), so
its importance ratio is ~e^6: the GradMonitor's detector sees the spike and the localizer names
the tokens of that response that carry the step (often one: a stale token's ratio multiplies its own
gradient only), with advantage / ratio / log-prob / old log-prob columns in the attribution table;
the console's culprit line shows the ratio and both log-probs.

    python examples/rl_grpo.py --steps 60 --inject-step 40 --tracker none

The console is the script's stdout; each run writes to a new ``runs/rl_grpo/<date>_<time>``.
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from gradloc_track import GradMonitor
from gradloc_track.artifacts import SpikeArtifactWriter
from gradloc_track.config import LocateConfig, TrackerConfig
from gradloc_track.console import TrainConsole, closing_lines
from gradloc_track.demo.data import ByteTokenizer
from gradloc_track.demo.model import TinyGPT
from gradloc_track.demo.out_dir import run_dir_for
from gradloc_track.demo.threads import set_threads
from gradloc_track.spikes import SpikeContext, SpikeDetector
from gradloc_track.trackers import make_tracker
from gradloc_track.trackers.quiet import quiet_backend_noise

PROMPT_LEN, RESP_LEN = 4, 3  # "a+b=" and up to 3 answer bytes
TOK = ByteTokenizer()


def encode(s: str) -> list[int]:
    return TOK.encode(s)


def pretrain(policy: TinyGPT, steps: int, rng: random.Random) -> None:
    """A few supervised steps on "a+b=c\\n" so that rewards are neither all 0 nor all 1."""
    opt = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    for _ in range(steps):
        rows = []
        for _ in range(32):
            a, b = rng.randrange(10), rng.randrange(10)
            rows.append(encode(f"{a}+{b}={a + b}\n".ljust(PROMPT_LEN + RESP_LEN + 1, "\n")))
        seq = torch.tensor(rows)  # (B, 8)
        logits = policy(seq[:, :-1])
        loss = F.cross_entropy(logits[:, PROMPT_LEN - 1:].reshape(-1, 256), seq[:, PROMPT_LEN:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()


@torch.no_grad()
def sample(policy: TinyGPT, prompts: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample RESP_LEN tokens per prompt; returns (sequences (B, P+R), behaviour log-probs (B, R))."""
    seq, logps = prompts, []
    for _ in range(RESP_LEN):
        probs = policy(seq)[:, -1].float().softmax(-1)  # (B, V)
        nxt = torch.multinomial(probs, 1, generator=gen)  # (B, 1)
        logps.append(probs.gather(1, nxt).log())
        seq = torch.cat([seq, nxt], dim=1)
    return seq, torch.cat(logps, dim=1)


def reward(answer: str, a: int, b: int) -> float:
    return 1.0 if answer.strip().startswith(str(a + b)) and answer.strip()[: len(str(a + b))] == str(a + b) else 0.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--inject-step", type=int, default=50)
    ap.add_argument("--pretrain-steps", type=int, default=150)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="responses per prompt (GRPO group)")
    ap.add_argument("--tracker", default="none", choices=["none", "mlflow", "wandb", "both"])
    ap.add_argument("--out-dir", default=None, help="the run dir (default: a new runs/rl_grpo/<date>_<time>)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: half the cores, at most 4)")
    return ap.parse_args(argv)


@dataclass
class Rollout:
    """One step's sampled responses, scored."""

    seq: torch.Tensor  # (B, P+R) prompt + sampled response
    old_logp: torch.Tensor  # (B, R) behaviour log-probs of the sampled tokens
    answers: list[str]
    rewards: torch.Tensor  # (B,)
    adv: torch.Tensor  # (B,) group-normalised advantages


def rollout(policy: TinyGPT, args: argparse.Namespace, rng: random.Random, gen: torch.Generator) -> Rollout:
    """``--group`` responses to each of ``--prompts`` "a+b=" prompts, rewarded and group-normalised (GRPO)."""
    pairs = [(rng.randrange(10), rng.randrange(10)) for _ in range(args.prompts)]
    prompts = torch.tensor([encode(f"{a}+{b}=") for a, b in pairs for _ in range(args.group)])
    seq, old_logp = sample(policy, prompts, gen)  # (B, 7), (B, 3)
    answers = [TOK.decode(r.tolist()) for r in seq[:, PROMPT_LEN:]]
    rewards = torch.tensor([reward(ans, *pairs[i // args.group]) for i, ans in enumerate(answers)])
    grouped = rewards.view(args.prompts, args.group)
    adv = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).view(-1)  # (B,)
    return Rollout(seq, old_logp, answers, rewards, adv)


def loss_terms(r: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets, the response-token mask and the behaviour log-probs, all (B, P+R-1)."""
    B, L = r.seq.shape
    x, y = r.seq[:, :-1], r.seq[:, 1:]  # (B, 6): targets at index >= PROMPT_LEN-1 are the response
    mask = torch.zeros(B, L - 1)
    mask[:, PROMPT_LEN - 1:] = 1.0
    behaviour = torch.zeros(B, L - 1)
    behaviour[:, PROMPT_LEN - 1:] = r.old_logp
    return x, y, mask, behaviour


def inject_stale_logprobs(r: Rollout, behaviour: torch.Tensor, step: int) -> dict:
    """The bug: one response's behaviour log-probs are stale, so its importance ratio is ~e^6."""
    k = int(r.adv.abs().argmax())  # a response whose advantage is not zero
    behaviour[k, PROMPT_LEN - 1:] -= 6.0
    injected = {"step": step, "sample": k, "positions": list(range(PROMPT_LEN - 1, behaviour.shape[1]))}
    print(f"step {step}: stale log-probs injected into response {k} ({r.answers[k]!r}), "
          f"positions {injected['positions']}", flush=True)
    return injected


def grpo_loss(policy: TinyGPT, x, y, mask, behaviour, adv_bt, cache: dict[str, torch.Tensor]):
    """``loss_fn(keep)``: the importance-weighted surrogate over the kept tokens, FIXED normaliser."""
    n_tokens = float(mask.sum())

    def loss_fn(keep: torch.Tensor) -> torch.Tensor:
        logp = policy(x).float().log_softmax(-1).gather(2, y[..., None]).squeeze(-1)  # (B, 6)
        ratio = (logp - behaviour).exp() * mask
        cache["logp"], cache["ratio"] = logp.detach(), ratio.detach()
        return -(ratio * adv_bt * keep).sum() / n_tokens  # fixed normaliser

    return loss_fn


@dataclass
class Results:
    spikes: list = field(default_factory=list)  # the GradStats of each step whose spike fired
    events_at: list[int] = field(default_factory=list)
    localized: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    rewards_seen: list[float] = field(default_factory=list)
    injected: dict = field(default_factory=dict)


def train(args, policy: TinyGPT, opt, monitor: GradMonitor, tracker, rng, gen) -> Results:
    res = Results()
    console = TrainConsole()
    which = torch.arange(args.prompts * args.group)  # (B,) a response's group (its prompt) and index in it
    for step in range(args.steps):
        r = rollout(policy, args, rng, gen)
        res.rewards_seen.append(float(r.rewards.mean()))
        x, y, mask, behaviour = loss_terms(r)
        if step == args.inject_step:
            res.injected = inject_stale_logprobs(r, behaviour, step)
        adv_bt = r.adv[:, None].expand_as(mask) * mask  # (B, 6)
        rng_state = torch.get_rng_state()
        cache: dict[str, torch.Tensor] = {}
        loss_fn = grpo_loss(policy, x, y, mask, behaviour, adv_bt, cache)
        opt.zero_grad(set_to_none=True)
        loss_fn(mask).backward()
        ctx = SpikeContext(loss_fn, mask, input_ids=y, tokenizer=TOK, rng_state=rng_state,
                           extra_columns={"advantage": adv_bt, "ratio": cache["ratio"], "logprob": cache["logp"],
                                          "old_logprob": behaviour * mask},
                           sample_columns={"reward": r.rewards, "group": which // args.group,
                                           "index": which % args.group})
        stats = monitor.after_backward(step, spike_context=ctx)
        opt.step()
        tracker.log_metrics({"rl/reward": res.rewards_seen[-1]}, step)
        if stats.events:  # the block names "completion i of group g, reward r", its tokens and share
            console.spike(stats, Path(args.out_dir))
            res.spikes.append(stats)
            res.events_at.append(step)
        if stats.locate is not None:
            res.localized[step] = [(c.batch, c.position) for c in stats.locate.tokens]
    return res


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    try:
        out = args.out_dir = run_dir_for(args.out_dir, "rl_grpo")
    except ValueError as exc:
        sys.exit(f"error: {exc}")
    set_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    policy = TinyGPT(vocab_size=256, n_layer=2, n_head=2, d_model=64, max_seq_len=PROMPT_LEN + RESP_LEN)
    pretrain(policy, args.pretrain_steps, rng)
    opt = torch.optim.AdamW(policy.parameters(), lr=5e-4)
    name = f"rl_grpo seed={args.seed} {time.strftime('%m-%d %H:%M:%S')}"  # tells runs apart in the chart view
    tracker = make_tracker(TrackerConfig(kind=args.tracker), run_dir=out, run_name=name)
    monitor = GradMonitor(policy, tracker=tracker, detector=SpikeDetector(warmup_steps=10),
                          locate_config=LocateConfig(), artifact_writer=SpikeArtifactWriter(tracker, run_dir=out))
    status = "failed"
    try:
        res = train(args, policy, opt, monitor, tracker, rng, gen)
        status = "success"
    finally:
        tracker.finish(status)
    summary = {"events_at": res.events_at, "localized": res.localized, "injected": res.injected,
               "mean_reward": sum(res.rewards_seen[-10:]) / max(1, len(res.rewards_seen[-10:]))}
    TrainConsole().summary(closing_lines(f"done: {args.steps} steps, mean reward of the last 10 "
                                         f"{summary['mean_reward']:.2f}", res.spikes, out))
    return summary


if __name__ == "__main__":
    quiet_backend_noise()  # our command: no MLflow store-creation lines or download bars
    main()
