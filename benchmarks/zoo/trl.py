"""The TRL family: ``GRPOTrainer`` on a tiny random-init GPT-2 (2 layers, d=64, the demo's BPE) with
``GradLocCallback`` (its defaults), as ``examples/trl_grpo.py`` runs it: a rule reward (the share of
letters and spaces), 16 completions of 12 tokens per step in groups of 4, ``num_iterations=2`` (each
generation trains two steps, so TRL keeps the sampling policy's log-probs), fp32, TRL's default loss
(``dapo``), rewards centred per group without scaling (``scale_rewards="none"``, Dr. GRPO's advice),
TRL's gradient clipping off (``max_grad_norm=0``: with Trainer's default 1.0 a spike's step is cut to
a normal step's size, and these injections do no more than a step on another batch would).

Scenarios, one injection per run (runs are identical to their clean twin until then, so the harm of
the injected step is exact): ``stale_logprob`` (one completion's old log-probs 6 nats stale, with a
negative advantage PPO's clip does not bound: the example's bug) and ``reward_outlier`` (one
completion's reward 100, a reward-model bug; it trains both steps of its generation). Clean runs:
``clean`` (the twin: a policy that is learning) and ``converged`` (a policy first trained to continue
one sentence, so most groups are four identical completions whose advantages are float rounding, and
a sampled low-probability token is the only thing that moves a step: the RL false events of issue 26).

Harm, per injected step and from the same state (``Harm`` holds KLs here, not losses): how far the
injected step moves the policy from where the clean step would (mean KL between their next-token
distributions on held-out corpus text), against how far the clean step itself moves it (``swap``).
The clean step is TRL's own loss on the same batch without the change (the fresh log-probs, the
reward a correct reward function gives).
The final gap is held-out loss against the twin's.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .culprits import rows_of
from .demo import localize_if
from .measure import adam_signals, grads_of, set_grads, stepped, weight_norm
from .record import FeedRecorder, Harm, RunRecord, StepRecord, live_outcome

STALE = 6.0
SENTENCE = "the quick brown fox jumps over the lazy dog and runs into the wood . "
SCENARIOS = {"stale_logprob": "data", "reward_outlier": "data"}
# the held-out zoo's (zoo/grpo.py, zoo/split.py): a log-prob mismatch on 3 tokens of one completion, and
# one completion that the sampler returned as random tokens (it trains both steps of its generation)
EXTRA = {"stale_tokens": "off_policy", "garbage_completion": "data"}
ALL = {**SCENARIOS, **EXTRA}
STALE_TOKENS = 3


@dataclass
class TRLSetting:
    steps: int = 40
    clean_steps: int = 60
    inject_at: int = 31  # a generation step (generation at odd steps with num_iterations=2)
    batch: int = 16
    generations: int = 4
    completion_len: int = 12
    lr: float = 1e-3
    pretrain_steps: int = 150  # the converged policy's supervised start
    warmup: int = 20
    detector: dict = field(default_factory=dict)

    @classmethod
    def quick(cls) -> "TRLSetting":
        return cls(steps=30, clean_steps=30, inject_at=25, pretrain_steps=60)


def setting(quick: bool) -> TRLSetting:
    return TRLSetting.quick() if quick else TRLSetting()


def prose_reward(completions, **kwargs) -> list[float]:
    return [sum(ch.isalpha() or ch == " " for ch in c) / max(1, len(c)) for c in completions]


def context(s: TRLSetting) -> tuple:
    from gradloc_track.demo.data import load_corpus
    from gradloc_track.demo.tokenizer import BpeTokenizer

    corpus = load_corpus()
    bpe = BpeTokenizer.train_or_load(corpus, 512)
    ids = torch.tensor(bpe.encode(corpus[200000:230000]))
    rows = ids[: (len(ids) // 33) * 33].view(-1, 33)[:8]  # (8, 33) held-out text
    prompts = []
    for para in corpus.split("\n\n"):
        words = para.split()
        if len(words) >= 8 and sum(w.isalpha() for w in words[:6]) >= 5:
            prompts.append(" ".join(words[:6]))
    return bpe, rows, prompts


def heldout(model, rows: torch.Tensor) -> float:
    was = model.training
    model.eval()
    with torch.no_grad():
        lg = model(input_ids=rows[:, :-1]).logits.float()
        out = float(F.cross_entropy(lg.flatten(0, 1), rows[:, 1:].flatten()))
    model.train(was)
    return out


def kl(p_model, q_model, rows: torch.Tensor) -> float:
    """Mean KL(p || q) of the two policies' next-token distributions over the held-out rows."""
    with torch.no_grad():
        lp, lq = (m(input_ids=rows[:, :-1]).logits.float().log_softmax(-1) for m in (p_model, q_model))
        return float((lp.exp() * (lp - lq)).sum(-1).mean())


def gpt2(bpe, tok, seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(vocab_size=bpe.vocab_size, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=tok.pad_token_id,
                                      eos_token_id=tok.pad_token_id, pad_token_id=tok.pad_token_id))


def pretrain(model, bpe, steps: int, seed: int) -> list[str]:
    """Teach the policy one sentence, so it continues it almost deterministically; returns prompts from it."""
    ids = torch.tensor(bpe.encode(SENTENCE * 40))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        starts = torch.randint(0, len(ids) - 33, (16,), generator=g)
        b = torch.stack([ids[i: i + 33] for i in starts.tolist()])
        opt.zero_grad()
        F.cross_entropy(model(input_ids=b[:, :-1]).logits.flatten(0, 1), b[:, 1:].flatten()).backward()
        opt.step()
    words = SENTENCE.split()
    return [" ".join(words[i: i + 4]) for i in range(len(words) - 4)]


def make_trainer_class(base, run: "TRLRun"):
    class ZooGRPOTrainer(base):
        def _prepare_inputs(self, generation_batch):
            inputs = super()._prepare_inputs(generation_batch)
            step = self.state.global_step + 1
            if run.scenario == "reward_outlier" and step in run.injected and self.model.training:
                run.clean_inputs = run.without_outlier(inputs, self.num_generations)
                row0 = (inputs["gradloc_group"] == 0) & (inputs["gradloc_index"] == 0)  # the outlier's completion
                run.truth[step] = [{"level": "sample", "batch": int(row0.float().argmax())}]
            if run.scenario == "garbage_completion" and step in run.injected and self.model.training:
                run.find_garbage(inputs, step)
            if run.scenario not in ("stale_logprob", "stale_tokens") or not self.model.training \
                    or step != run.s.inject_at:
                return inputs
            run.clean_inputs = inputs
            inputs = dict(inputs)  # the buffered batch is reused by the next iteration: leave it alone
            k = int(inputs["advantages"].argmin())
            old = inputs["old_per_token_logps"].clone()
            if run.scenario == "stale_tokens":  # 3 tokens of the completion, from its middle
                n = int(inputs["completion_mask"][k].sum())
                j = max(0, n // 2 - 1)
                old[k, j: j + STALE_TOKENS] -= STALE
                P = inputs["prompt_ids"].shape[1]  # completion token j is the term at model position P-1+j
                run.truth[step] = [{"level": "token", "batch": k, "start": P - 1 + t, "end": P + t}
                                   for t in range(j, min(n, j + STALE_TOKENS))]
            else:
                old[k] -= STALE
                run.truth[step] = [{"level": "sample", "batch": k}]
            inputs["old_per_token_logps"] = old
            run.injected.add(step)
            return inputs

    return ZooGRPOTrainer


def record_losses(trainer, run: "TRLRun") -> None:
    """Keep each step's loss and token count, wrapping ``compute_loss`` on the instance: a subclass that
    overrides it computes a loss of its own for the callback (detection only), this one does not."""
    inner = trainer.compute_loss

    def compute_loss(model, inputs, *args, **kwargs):
        loss = inner(model, inputs, *args, **kwargs)
        run.last_loss = float(loss.detach())  # host sync: the zoo's own record
        run.last_tokens = int(inputs["completion_mask"].sum())
        return loss

    trainer.compute_loss = compute_loss


@dataclass
class TRLRun:
    scenario: str
    seed: int
    s: TRLSetting
    rows: torch.Tensor
    injected: set = field(default_factory=set)
    trainer: object = None
    last_loss: float | None = None
    last_tokens: int = 1
    clean_inputs: dict | None = None  # the injected step's batch as it should have been
    outlier: float = 0.0  # reward given minus reward due, on row 0 of the generation batch
    truth: dict = field(default_factory=dict)  # injected step -> the units a culprit row should name
    garbage: list | None = None  # garbage_completion: the random completion the sampler returned

    def garbage_generate(self, generate):
        """``model.generate`` that returns random tokens for row 0 at the first generation from inject_at."""
        def wrapped(*args, **kwargs):
            out = generate(*args, **kwargs)
            step = self.trainer.state.global_step + 1
            if self.garbage is None and step >= self.s.inject_at and self.trainer.model.training:
                P = kwargs["input_ids"].shape[1]
                g = torch.Generator().manual_seed(self.seed * 7919 + step)
                junk = torch.randint(2, int(self.trainer.model.config.vocab_size), (out.shape[1] - P,), generator=g)
                out = out.clone()
                out[0, P:] = junk  # no end-of-sequence: the whole completion is junk
                self.garbage = junk.tolist()
                self.injected |= {step, step + 1}
            return out
        return wrapped

    def find_garbage(self, inputs: dict, step: int) -> None:
        """Which row of the training batch holds the garbage completion (TRL shuffles the generation)."""
        ids = inputs["completion_ids"]
        ref = torch.tensor(self.garbage[: ids.shape[1]])
        k = int(next(i for i in range(ids.shape[0]) if torch.equal(ids[i, : len(ref)], ref)))
        self.truth[step] = [{"level": "sample", "batch": k}]
        clean = dict(inputs)
        mask = inputs["completion_mask"].clone()
        mask[k] = 0  # the step without the garbage completion
        clean["completion_mask"] = mask
        self.clean_inputs = clean

    def without_outlier(self, inputs: dict, group: int) -> dict:
        """The batch with the advantages a correct reward gives (rewards centred per group, unscaled)."""
        out = dict(inputs)
        g, i = inputs.get("gradloc_group"), inputs.get("gradloc_index")
        if g is None or i is None:
            raise RuntimeError("the zoo needs GradLocCallback's group/index tags on the GRPO batch")
        hit = (g == 0).float() * ((i == 0).float() - 1.0 / group)  # (B,) row 0's share of its group's centring
        adv = inputs["advantages"]
        out["advantages"] = adv - self.outlier * (hit if adv.dim() == 1 else hit[:, None])
        return out

    def harm(self, model, optimizer) -> Harm:
        """KL of the injected step's policy from the clean step's, and of the clean step's from now."""
        injected = grads_of(model)
        model.zero_grad(set_to_none=True)
        base = type(self.trainer).__mro__[1]  # GRPOTrainer's own compute_loss: not the callback's recorder
        with torch.enable_grad():
            base.compute_loss(self.trainer, model, self.clean_inputs).backward()
        clean = grads_of(model)
        set_grads(model, injected)
        m_clean, m_inj = stepped(model, optimizer, clean), stepped(model, optimizer, injected)
        step = self.trainer.state.global_step + 1
        return Harm(step, kl(m_inj, m_clean, self.rows), 0.0, kl(m_clean, model, self.rows))

    def reward(self, completions, **kwargs) -> list[float]:
        r = prose_reward(completions)
        step = self.trainer.state.global_step + 1
        if self.scenario == "reward_outlier" and step >= self.s.inject_at and not self.injected:
            self.outlier = 100.0 - r[0]
            r[0] = 100.0  # a reward-model bug on one completion
            self.injected |= {step, step + 1}  # its advantages train both iterations of this generation
        return r


def run(scenario: str, seed: int, s: TRLSetting, bpe, rows, prompts) -> RunRecord:
    from datasets import Dataset
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from gradloc_track.integrations.trl import GradLocCallback

    tok = bpe.to_transformers()
    model = gpt2(bpe, tok, seed)
    if scenario == "converged":
        prompts = pretrain(model, bpe, s.pretrain_steps, seed)
    steps = s.clean_steps if scenario in ("clean", "converged", "calibration") else s.steps
    tr = TRLRun(scenario, seed, s, rows)
    rec = RunRecord("trl", scenario, seed, ALL.get(scenario, "none"), warmup=s.warmup,
                    twin="clean" if scenario in ALL else scenario)
    gl = GradLocCallback(tracker="none", spikes=dict(s.detector), locate={"max_events": 10 ** 6}, tokenizer=bpe,
                         log_every=10 ** 9)

    class Record(TrainerCallback):
        feed: FeedRecorder | None = None

        def on_train_begin(self, args, state, control, **kw):  # after GradLocCallback built its handle
            Record.feed = FeedRecorder(gl.handle.monitor.detector)

        def on_step_begin(self, args, state, control, **kw):
            step = state.global_step + 1  # the injection lands on inject_at or the next generation step
            gl.handle.monitor.responder.config = localize_if(scenario in ALL and 0 <= step - s.inject_at <= 2)

        def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None, **kw):
            stats = gl.handle.last
            step = state.global_step + 1
            sig = adam_signals(model, optimizer)
            fired, probes, secs, cause = live_outcome(stats)
            rec.steps.append(StepRecord(step, stats.global_norm, stats.layer_norms, tr.last_tokens, step in tr.injected,
                                        tr.last_loss, None, float(optimizer.param_groups[0]["lr"]), sig.get("update"),
                                        sig.get("update_layers"), sig.get("gv_elem"), sig.get("gv_tensor"),
                                        weight_norm(model), fired, probes, secs, cause, fed=Record.feed.take(),
                                        culprits=rows_of(stats), truth=tr.truth.get(step),
                                        detail=getattr(stats, "cause_detail", None) if fired else None))
            if step in tr.injected and tr.clean_inputs is not None:
                rec.harms.append(tr.harm(model, optimizer))

        def on_step_end(self, args, state, control, model=None, **kw):
            rec.steps[-1].heldout = heldout(model, rows)

    config = GRPOConfig(output_dir="/tmp/gradloc-zoo-trl", per_device_train_batch_size=s.batch,
                        num_generations=s.generations, max_completion_length=s.completion_len, num_iterations=2,
                        max_steps=steps, learning_rate=s.lr, lr_scheduler_type="constant", scale_rewards="none",
                        logging_strategy="no", report_to=[], save_strategy="no", use_cpu=True, disable_tqdm=True,
                        max_grad_norm=0.0, bf16=False, seed=seed)
    trainer = make_trainer_class(GRPOTrainer, tr)(
        model=model, reward_funcs=tr.reward, args=config, train_dataset=Dataset.from_dict({"prompt": prompts * 20}),
        processing_class=tok, callbacks=[gl, Record()])
    trainer.remove_callback(PrinterCallback)
    record_losses(trainer, tr)
    tr.trainer = trainer
    if scenario == "garbage_completion":
        model.generate = tr.garbage_generate(model.generate)
    t0 = time.perf_counter()
    trainer.train()
    for r in rec.steps:
        r.injected = r.step in tr.injected
    rec.seconds = time.perf_counter() - t0
    rec.final_loss = heldout(model, rows)
    return rec


def finish(runs: list[RunRecord]) -> None:
    """The clean twin's held-out loss at the scenario runs' last step (their final gap)."""
    twins = {r.seed: r for r in runs if r.scenario == "clean"}
    for r in runs:
        twin = twins.get(r.seed)
        if r.scenario in ALL and twin is not None:
            twin.twin_loss = next((s.heldout for s in twin.steps if s.step == r.steps[-1].step), math.nan)


def jobs(s: TRLSetting, seeds: list[int], scenarios: list[str] | None = None) -> list[tuple[str, int]]:
    names = [n for n in (scenarios or list(SCENARIOS)) if n in SCENARIOS]
    clean = [(c, seed) for seed in seeds for c in ("clean", "converged")]
    return [(n, seed) for seed in seeds for n in names] + clean + [("calibration", 1000)]
