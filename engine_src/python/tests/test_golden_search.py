"""The big configs' golden search (streaming reference, parallel jobs, resumable) chooses what
gen_model's in-memory search chooses."""

import dataclasses
import json
import pickle
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import gen_model
import golden_search
from golden_search import Config, Job
from kdtree_ref.weights import Weights
from kdtree_ref.model import Transformer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
import small_k2  # noqa: E402

# k2small with a noisy-prompt rule, so that every kind of job runs (k2wide's rule has noise)
RULE = dataclasses.replace(small_k2.RULE, prompt_noise=1e-4)
CONFIG = Config(small_k2.ARGS, small_k2.RECIPE, RULE)


def in_memory_golden() -> gen_model.Golden:
    """gen_model.search_prompt's choice over the full float64 models of k2small's two bundles."""
    source = Weights(small_k2.ARGS, direct_int4=True)
    models = {q: Transformer(small_k2.ARGS, gen_model.bundle_weights(source, gen_model.quant_header(small_k2.RECIPE, q))[1])
              for q in ("fp32", "int4")}
    return gen_model.search_prompt(small_k2.ARGS, models["fp32"], models["int4"], RULE)


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """(its state folder, exit status, result) of a whole streaming search on k2small, result.json written."""
    state = tmp_path_factory.mktemp("search")
    status, result = golden_search.search(CONFIG, state, workers=2, deadline=float("inf"))
    (state / "result.json").write_text(json.dumps(result))
    return state, status, result


def test_streaming_search_chooses_the_in_memory_searchs_golden(searched):
    _, status, result = searched
    want = in_memory_golden()
    assert status == 0 and result["accepted"] == want.candidate
    fp32, int4 = result["bundles"]
    assert fp32["prompt"] == [int(t) for t in want.prompt]
    assert fp32["golden"] == [int(t) for t in want.fp32.tokens[0]]
    assert int4["golden"] == [int(t) for t in want.int4.tokens[0]]
    assert fp32["golden"] != int4["golden"]
    assert fp32["golden_margins"] == [gen_model.rounded_margin(m) for m in want.fp32.logit_margin[0]]
    # every candidate before the accepted one was refused, saying why
    assert sorted(map(int, result["refused"])) == list(range(want.candidate))
    assert all(result["refused"].values())
    json.dumps(result)


def test_a_job_stopped_at_its_deadline_goes_on_from_its_saved_step(tmp_path, monkeypatch):
    job = Job(CONFIG.args.name, 0, "int4")
    (tmp_path / "whole").mkdir()
    (tmp_path / "part").mkdir()
    whole = golden_search.run_job(CONFIG, job, str(tmp_path / "whole"), float("inf"))
    ticks = iter(np.arange(0.0, 1000.0))             # one tick per look at the clock
    monkeypatch.setattr(golden_search, "clock", lambda: float(next(ticks)))
    paused = golden_search.run_job(CONFIG, job, str(tmp_path / "part"), deadline=5.0)
    assert paused["status"] == "paused" and 0 < paused["steps"] < gen_model.GOLDEN_LEN
    monkeypatch.undo()
    resumed = golden_search.run_job(CONFIG, job, str(tmp_path / "part"), float("inf"))
    assert {**resumed, "cpu_s": 0} == {**whole, "cpu_s": 0}
    # an ended job's outcome is read back, not recomputed
    assert golden_search.run_job(CONFIG, job, str(tmp_path / "part"), deadline=-1.0) == resumed


def test_recompute_names_a_golden_token_the_streaming_reference_does_not_make():
    want = in_memory_golden()
    entries = {q: {"name": f"k2small_{q}", "prompt": [int(t) for t in want.prompt],
                   "golden": [int(t) for t in traj.tokens[0]]} for q, traj in (("fp32", want.fp32), ("int4", want.int4))}
    assert golden_search.recompute(CONFIG, entries, workers=2) is None
    entries["int4"]["golden"][17] = (entries["int4"]["golden"][17] + 1) % small_k2.ARGS.vocab_size
    problem = golden_search.recompute(CONFIG, entries, workers=2)
    assert problem.startswith("k2small_int4: the streaming reference's token 17 is ")


def test_a_finished_search_is_committed_to_the_expected_manifest_with_the_writers_digests(searched, tmp_path, monkeypatch):
    for table, value in ((gen_model.CONFIGS, small_k2.ARGS), (gen_model.RECIPES, small_k2.RECIPE), (gen_model.RULES, RULE)):
        monkeypatch.setitem(table, "k2small", value)
    state, _, result = searched
    expected = tmp_path / "expected.json"
    shutil.copy(golden_search.gen_model.EXPECTED_MANIFEST, expected)
    before = json.loads(expected.read_text())
    assert golden_search.main(["--state", str(state), "--commit", str(expected), "--workers", "2"]) == 0
    after = json.loads(expected.read_text())
    assert after["bundles"][:len(before["bundles"])] == before["bundles"]          # the other configs untouched
    mine = {b["quant"]: b for b in after["bundles"] if b["config"] == "k2small"}
    out = tmp_path / "written"
    gen_model.main(["--out", str(out), "--configs", "k2small", "--golden", str(expected), "--workers", "2"])
    assert gen_model.check(json.loads((out / "manifest.json").read_text()), expected) is None
    assert mine["int4"]["golden"] == result["bundles"][1]["golden"] and mine["int4"]["needs"]["disk_bytes"] > 0
    assert mine["int4"]["streamed"] is True and mine["fp32"]["streamed"] is True     # the orchestrator's cue
    assert after["generator"]["golden_candidate"]["k2small"] == result["accepted"]
    # committing again replaces the entries, never doubles them
    golden_search.main(["--state", str(state), "--commit", str(expected), "--workers", "2"])
    assert json.loads(expected.read_text()) == after


def test_once_decided_the_jobs_still_running_pause_and_the_next_search_clears_it(searched, tmp_path):
    state, status, result = searched
    assert status == 0 and (state / golden_search.DECIDED).exists()
    (tmp_path / golden_search.DECIDED).touch()
    later = Job(CONFIG.args.name, result["accepted"] + 1, "fp32")
    assert golden_search.run_job(CONFIG, later, str(tmp_path), float("inf")) == {"status": "paused", "steps": 0}
    assert pickle.loads((tmp_path / f"{later.name}.pkl").read_bytes())["status"] == "running"   # kept, to go on
    assert golden_search.search(CONFIG, tmp_path, workers=1, deadline=-1.0)[0] == golden_search.EXIT_STOPPED
    assert not (tmp_path / golden_search.DECIDED).exists()


def test_a_job_stops_once_another_job_of_its_candidate_has_failed(tmp_path):
    failed = {"status": "ended", "outcome": {"status": "failed", "why": "step 3: logit margin 0.001 < 0.01"}}
    (tmp_path / "c0000-fp32.pkl").write_bytes(pickle.dumps(failed))
    outcome = golden_search.run_job(CONFIG, Job(CONFIG.args.name, 0, "int4"), str(tmp_path), float("inf"))
    assert outcome["status"] == "abandoned" and outcome["why"] == "c0000-fp32 failed: step 3: logit margin 0.001 < 0.01"
    assert len(pickle.loads((tmp_path / "c0000-int4.pkl").read_bytes())["steps"]) == 1    # stopped at its first step
    # another candidate's failure does not stop it
    assert golden_search.run_job(CONFIG, Job(CONFIG.args.name, 1, "int4"), str(tmp_path), float("inf"))["status"] != "abandoned"
