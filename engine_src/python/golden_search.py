#!/usr/bin/env python3
"""The golden prompt of a big config (k2wide) by the streaming float64 reference: parallel, resumable.

    python golden_search.py --config k2wide --state DIR [--workers N] [--stop-after SECONDS]

The same choice gen_model.search_prompt makes for the small configs, with the models of
kdtree_ref/streaming.py (no bundle in memory): the first candidate prompt (prompts_from(...,
"golden", ...), in index order) whose FP32-labelled and INT4 greedy trajectories keep every held
margin of the config's golden rule (held_margins, robust), are not degenerate, differ from each
other, and come out the same with the prompt's router scores moved by the rule's noise.

Each trajectory is a job (candidate, quant, noisy) run in its own worker process; a job saves
its state (KV cache, steps so far) in DIR after the prefill and after every decode step, so a
search stopped at any point (--stop-after, a killed command) goes on from there when run again
with the same DIR. A plain trajectory stops at the first step whose margins fail the rule, a
noisy one at the first token that differs from its plain twin's; noisy jobs run only for a
candidate whose plain pair passed. The result, DIR/result.json, holds the two bundles' manifest
entries without their sha256 and needs (gen_model --golden writes the bundles and adds them),
and the candidates tried with why each was refused. Prints progress lines (kdtree_ref.progress)
and exits 0 with the result, 3 when stopped before one was found, 1 when none of
gen_model.MAX_CANDIDATES passes.
"""

import argparse
import dataclasses
import json
import os
import pickle
import sys
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import gen_model  # first: it sets the BLAS thread counts (one per worker) before NumPy loads
import numpy as np
from kdtree_ref import progress
from kdtree_ref.model import KVCache, ModelArgs, decode_step, generate, prefill, top_margin
from kdtree_ref.streaming import StreamingTransformer
from kdtree_ref.weights import Weights

QUANTS = ("fp32", "int4")
clock = time.time   # what deadlines are judged by
EXIT_STOPPED = 3


@dataclass(frozen=True)
class Config:
    """What a search needs of a config: its ModelArgs, Recipe and GoldenRule (gen_model's tables)."""

    args: ModelArgs
    recipe: gen_model.Recipe
    rule: gen_model.GoldenRule

    @classmethod
    def named(cls, name: str) -> "Config":
        """gen_model's config `name`."""
        return cls(gen_model.CONFIGS[name], gen_model.RECIPES.get(name, gen_model.Recipe()), gen_model.RULES[name])


@dataclass(frozen=True)
class Job:
    """One greedy trajectory of the search."""

    config: str
    candidate: int
    quant: str
    noisy: bool = False

    @property
    def name(self) -> str:
        return f"c{self.candidate:04d}-{self.quant}{'-noisy' if self.noisy else ''}"


def streaming_model(config: Config, job: Job):
    """The streaming reference of the job's bundle (with the prompt's router noise when noisy)."""
    source = Weights(config.args, direct_int4=config.recipe.direct_int4)
    model = StreamingTransformer(source, gen_model.quant_header(config.recipe, job.quant))
    if not job.noisy:
        return model
    # PromptRouterNoise's forward and gate_scores over the streaming model's weights and products
    noisy = type("NoisyStreaming", (gen_model.PromptRouterNoise, StreamingTransformer), {})
    return noisy(model, config.rule.prompt_noise, f"{config.args.name}/{job.quant}")


def _save(path: Path, state: dict) -> None:
    """Write a job's state atomically (a killed worker leaves the previous one)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(state))
    os.replace(tmp, path)


def step_failure(rule: gen_model.GoldenRule, step: int, logit: float, route: float, group: float) -> str | None:
    """Why a step's margins fail the rule's held margins (held_margins, robust), or None."""
    if logit < gen_model.MIN_LOGIT_MARGIN:
        return f"step {step}: logit margin {logit:.3g} < {gen_model.MIN_LOGIT_MARGIN}"
    if step == 0 and rule.prompt_noise:
        return None                         # the prompt's routing is judged by the noisy twin instead
    if route < rule.min_route_margin:
        return f"step {step}: routing margin {route:.3g} < {rule.min_route_margin}"
    if group < rule.min_group_margin:
        return f"step {step}: group margin {group:.3g} < {rule.min_group_margin}"
    return None


def run_job(config: Config, job: Job, state_dir: str, deadline: float, plain_tokens: list[int] | None = None) -> dict:
    """Run (or go on with) one trajectory until it ends, fails, or `deadline` (time.time()) passes
    at a step boundary; returns its outcome: status passed / failed (with why) / paused."""
    path = Path(state_dir) / f"{job.name}.pkl"
    args, rule = config.args, config.rule
    state = pickle.loads(path.read_bytes()) if path.exists() else None
    if state and state["status"] != "running":
        return state["outcome"]
    if clock() > deadline:
        return {"status": "paused", "steps": len(state["steps"]) if state else 0}
    started = time.process_time()
    model = streaming_model(config, job)
    if state is None:
        prompt = gen_model.prompts_from(args, "golden", 1, job.candidate, rule.prompt_len)
        cache = KVCache(args, 1, capacity=rule.prompt_len + gen_model.GOLDEN_LEN, dtype=np.float64)
        out = prefill(model, prompt, cache)
        state = {"status": "running", "cache": cache, "steps": [], "logits": out.logits[0, -1], "cpu_s": 0.0,
                 "route": float(out.route_margin.min()), "group": float(out.group_margin.min())}
        state["cpu_s"] = time.process_time() - started
        _save(path, state)
        started = time.process_time()
    while True:
        logits, step = state["logits"], len(state["steps"])
        token = int(np.argmax(logits))
        margins = (float(top_margin(logits)), state["route"], state["group"])
        state["steps"].append((token, *margins))
        outcome = _judge(job, rule, state["steps"], plain_tokens) or _refused_elsewhere(job, Path(state_dir))
        if outcome is None and (clock() > deadline or (Path(state_dir) / DECIDED).exists()):
            state["steps"].pop()
            return {"status": "paused", "steps": step}
        if outcome is not None:
            outcome["cpu_s"] = round(state["cpu_s"] + time.process_time() - started, 1)
            state.update(status="ended", outcome=outcome, cache=None)
            _save(path, state)
            return outcome
        out = decode_step(model, np.array([token]), state["cache"])
        now = time.process_time()
        state.update(logits=out.logits[0, 0], route=float(out.route_margin[0, 0]), group=float(out.group_margin[0, 0]),
                     cpu_s=state["cpu_s"] + now - started)
        started = now
        _save(path, state)


# Written in the state folder once the search has decided: the jobs still running pause at their
# next step (their states kept) instead of running to the end of trajectories nobody waits for.
DECIDED = "decided"


def _refused_elsewhere(job: Job, state_dir: Path) -> dict | None:
    """An `abandoned` outcome once another job of the same candidate has failed (saved in state_dir):
    the candidate is refused, so the rest of this trajectory would decide nothing."""
    for path in state_dir.glob(f"c{job.candidate:04d}-*.pkl"):
        if path.name == f"{job.name}.pkl":
            continue
        try:
            other = pickle.loads(path.read_bytes())
        except (OSError, EOFError, pickle.UnpicklingError):
            continue            # being replaced right now: looked at again after the next step
        if other["status"] == "ended" and other["outcome"]["status"] == "failed":
            return {"status": "abandoned", "why": f"{path.stem} failed: {other['outcome']['why']}"}
    return None


def _judge(job: Job, rule: gen_model.GoldenRule, steps: list[tuple], plain_tokens: list[int] | None) -> dict | None:
    """The outcome once the newest step decides it (a failure, or the last step), else None."""
    step = len(steps) - 1
    token = steps[-1][0]
    if job.noisy:
        if plain_tokens is not None and token != plain_tokens[step]:
            return {"status": "failed", "why": f"noisy prompt routing: token {step} differs"}
    else:
        why = step_failure(rule, step, *steps[-1][1:])
        if why:
            return {"status": "failed", "why": why}
    if step + 1 < gen_model.GOLDEN_LEN:
        return None
    tokens = [s[0] for s in steps]
    problem = None if job.noisy else gen_model.degenerate(tokens)
    if problem:
        return {"status": "failed", "why": f"degenerate: {problem}"}
    margins = np.array([s[1:] for s in steps])
    return {"status": "passed", "tokens": tokens, "logit_margins": margins[:, 0].tolist(),
            "route_min": float(margins[:, 1].min()), "group_min": float(margins[:, 2].min())}


class Search:
    """The candidates' jobs and what they concluded (the parent process's view)."""

    def __init__(self, config: Config):
        self.config, self.noisy = config.args.name, bool(config.rule.prompt_noise)
        self.outcomes: dict[Job, dict] = {}
        self.refused: dict[int, str] = {}

    def verdict(self, candidate: int) -> str | None:
        """'accepted', 'refused', or None while undecided."""
        if candidate in self.refused:
            return "refused"
        plain = [self.outcomes.get(Job(self.config, candidate, q)) for q in QUANTS]
        noisy = [self.outcomes.get(Job(self.config, candidate, q, True)) for q in QUANTS] if self.noisy else []
        if all(o and o["status"] == "passed" for o in plain + noisy):
            return "accepted"
        return None

    def record(self, job: Job, outcome: dict) -> None:
        """Take a finished job's outcome; refuse its candidate when it decides that."""
        self.outcomes[job] = outcome
        if outcome["status"] == "abandoned":          # another job of its candidate failed: that one says why
            self.refused.setdefault(job.candidate, outcome["why"])
            return
        if outcome["status"] == "failed":
            self.refused[job.candidate] = f"{job.quant}{' noisy' if job.noisy else ''}: {outcome['why']}"
            return
        plain = [self.outcomes.get(Job(self.config, job.candidate, q)) for q in QUANTS]
        if all(o and o["status"] == "passed" for o in plain) and plain[0]["tokens"] == plain[1]["tokens"]:
            self.refused[job.candidate] = "INT4 golden equals FP32 golden"

    def ready_noisy(self, candidate: int) -> list[tuple[Job, list[int]]]:
        """The noisy jobs a candidate needs now (its plain pair passed and differs), with their plain tokens."""
        if candidate in self.refused or not self.noisy:
            return []
        plain = {q: self.outcomes.get(Job(self.config, candidate, q)) for q in QUANTS}
        if not all(o and o["status"] == "passed" for o in plain.values()):
            return []
        return [(Job(self.config, candidate, q, True), plain[q]["tokens"]) for q in QUANTS]


def entries(config: Config, candidate: int, search: Search) -> list[dict]:
    """The manifest entries of the accepted candidate's two bundles (no sha256 or needs: the writer's)."""
    args, rule = config.args, config.rule
    prompt = [int(t) for t in gen_model.prompts_from(args, "golden", 1, candidate, rule.prompt_len)[0]]
    out = []
    for quant in QUANTS:
        o = search.outcomes[Job(args.name, candidate, quant)]
        name = f"{args.name}_{quant}"
        out.append({"name": name, "file": f"model_{name}.kdtr", "config": args.name, "quant": quant,
                    "prompt": prompt, "golden": o["tokens"],
                    "margins": {"logit_min": gen_model.rounded_margin(min(o["logit_margins"])),
                                "route_min": gen_model.rounded_margin(o["route_min"]),
                                "group_min": gen_model.rounded_margin(o["group_min"])},
                    "golden_margins": [gen_model.rounded_margin(m) for m in o["logit_margins"]]})
    return out


def search(config: Config, state_dir: Path, workers: int, deadline: float) -> tuple[int, dict]:
    """Run the search until a candidate is accepted with every earlier one refused, the deadline,
    or MAX_CANDIDATES; returns (exit status, result)."""
    found = Search(config)
    pending, next_candidate, first_open = {}, 0, 0
    (state_dir / DECIDED).unlink(missing_ok=True)
    with ProcessPoolExecutor(max_workers=workers) as pool:
        while True:
            while first_open < next_candidate and found.verdict(first_open) == "refused":
                first_open += 1
            if first_open < next_candidate and found.verdict(first_open) == "accepted":
                (state_dir / DECIDED).touch()       # the later candidates' jobs still running: pause them
                break
            open_time = time.time() < deadline
            for c in range(first_open, next_candidate if open_time else 0):   # noisy jobs first: they decide
                for job, tokens in found.ready_noisy(c):
                    if job not in pending.values() and job not in found.outcomes:
                        pending[pool.submit(run_job, config, job, str(state_dir), deadline, tokens)] = job
            while open_time and len(pending) < workers and next_candidate < gen_model.MAX_CANDIDATES:
                for quant in QUANTS:
                    job = Job(config.args.name, next_candidate, quant)
                    pending[pool.submit(run_job, config, job, str(state_dir), deadline)] = job
                next_candidate += 1
            if not pending:
                status = EXIT_STOPPED if time.time() >= deadline else 1
                return status, _result(config, found, None, first_open)
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for future in done:
                job = pending.pop(future)
                outcome = future.result()
                if outcome["status"] == "paused":
                    continue
                found.record(job, outcome)
                progress.report(len(found.refused), None, "candidates",
                                f"{job.name}: {outcome['status']} {outcome.get('why', '')}")
    return 0, _result(config, found, first_open, first_open)


def _result(config: Config, found: Search, accepted: int | None, first_open: int) -> dict:
    refused = {str(c): why for c, why in sorted(found.refused.items()) if accepted is None or c < accepted}
    result = {"config": config.args.name, "rule": dataclasses.asdict(config.rule), "accepted": accepted,
              "refused": refused, "first_open": first_open}
    if accepted is not None:
        result["bundles"] = entries(config, accepted, found)
    return result


def _greedy(config: Config, label: str, prompt: list[int]) -> list[int]:
    model = streaming_model(config, Job(config.args.name, -1, label))
    return [int(t) for t in generate(model, np.array([prompt]), gen_model.GOLDEN_LEN).tokens[0]]


def recompute(config: Config, entries: dict[str, dict], workers: int) -> str | None:
    """The first difference between the golden tokens of a config's manifest entries ({label:
    entry}) and the streaming reference's greedy tokens after their prompts (one process each), or None."""
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(entries)))) as pool:
        made = {label: pool.submit(_greedy, config, label, e["prompt"]) for label, e in entries.items()}
        for label, future in made.items():
            tokens, want = future.result(), entries[label]["golden"]
            if tokens != want:
                at = gen_model.first_difference(tokens, want)
                return (f"{entries[label]['name']}: the streaming reference's token {at} is "
                        f"{tokens[at] if at < len(tokens) else 'missing'}, the golden says "
                        f"{want[at] if at < len(want) else 'nothing'}")
    return None


def commit(result_path: Path, expected_path: Path, workers: int) -> list[dict]:
    """Put a finished search's bundles into the expected manifest: their entries with sha256 and
    needs (gen_model's writer, hashing only), replacing that config's entries there, and the
    accepted candidate under generator.golden_candidate and the rule under generator.golden_rules."""
    result = json.loads(result_path.read_text())
    name = result["config"]
    if result.get("accepted") is None:
        raise SystemExit(f"golden_search: {result_path} holds no accepted candidate for {name}: nothing to commit")
    with tempfile.TemporaryDirectory() as out:
        entries, _ = gen_model.write_streamed(name, Path(out), result_path, workers, hash_only=True)
    expected = json.loads(expected_path.read_text())
    expected["bundles"] = [b for b in expected["bundles"] if b["config"] != name] + entries
    expected["generator"]["golden_candidate"][name] = result["accepted"]
    expected["generator"]["golden_rules"][name] = result["rule"]
    expected_path.write_text(json.dumps(expected, indent=1) + "\n")
    return entries


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="k2wide", choices=sorted(gen_model.CONFIGS))
    parser.add_argument("--state", type=Path, required=True, help="folder of the jobs' states and result.json")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--stop-after", type=float, default=float("inf"), metavar="SECONDS",
                        help="stop at the jobs' next step boundary after this long (resume with the same --state)")
    parser.add_argument("--commit", type=Path, metavar="EXPECTED_MANIFEST",
                        help="put the finished search of --state into this manifest (sha256 and needs by hashing "
                             "the bundles: about 13 CPU-minutes for k2wide) instead of searching")
    opts = parser.parse_args(argv)
    if opts.commit:
        for e in commit(opts.state / "result.json", opts.commit, max(1, opts.workers)):
            print(f"golden_search: {e['name']}: sha256 {e['sha256'][:16]}... committed to {opts.commit}")
        return 0
    opts.state.mkdir(parents=True, exist_ok=True)
    start = time.time()
    status, result = search(Config.named(opts.config), opts.state, max(1, opts.workers), start + opts.stop_after)
    result["seconds"] = round(time.time() - start, 1)
    (opts.state / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    said = {0: f"candidate {result['accepted']} accepted", 1: "no candidate passes",
            EXIT_STOPPED: f"stopped: candidates before {result['first_open']} refused, the rest undecided"}[status]
    print(f"golden_search {opts.config}: {said} ({len(result['refused'])} refused) in {result['seconds']} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
