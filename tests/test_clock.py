"""The virtual clock (fedskew.engine.clock): its arithmetic on hand cases, its sampling against the seed's
stream, the synchronous round policies (full wait, deadline, partial work, over-selection) end to end, exact
resume, and the one-line refusals of bad input."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedskew.algorithms import ALGORITHMS
from fedskew.algorithms.base import Payload, Upload
from fedskew.engine.clock import ClientSpeeds, VirtualClock, mostly_in, read_trace
from fedskew.engine.clock_config import ClockSection, Spread
from fedskew.engine.sampling import sampling_schedule
from fedskew.engine.types import ClientOutcome
from fedskew.errors import ConfigError
from fedskew.experiment.config import build_config
from fedskew.experiment.runner import build_data, build_simulation
from fedskew.testing import checked
from tests.conftest import StopRun, run_metrics, stop_after
from tests.test_contract import NAMES, tiny_config
from tests.test_contract_rules import empty_client_config

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "configs" / "system"


def clock_of(n: int, fraction: float = 1.0, rounds: int = 3, seed: int = 0, **section) -> VirtualClock:
    cfg = ClockSection(**section)
    speeds = ClientSpeeds.build(cfg, seed, [[1, 0]] * n)
    return VirtualClock(cfg, speeds, n, fraction, rounds, seed)


def outcome(cid: int, steps: int, down: int = 0, up: int = 0) -> ClientOutcome:
    """A client that trained ``steps`` steps and whose (empty) upload was accepted."""
    done = ClientOutcome(cid=cid, bytes_down=down, steps=steps, loss=0.0)
    done.accept(Upload(cid=cid, num_samples=1, payload=Payload(arrays={})))
    done.bytes_up = up
    return done


# ---------------------------------------------------------------------------- arithmetic on hand cases
def test_a_clients_duration_is_steps_times_step_time_plus_bytes_over_bandwidth():
    clock = clock_of(2, step_seconds=Spread(value=0.5, sigma=0), bytes_per_second=Spread(value=1000, sigma=0))
    assert clock.duration(0, steps=4, bytes_down=3000, bytes_up=1000) == 4 * 0.5 + 4000 / 1000  # 6 s
    assert clock.duration(1, steps=0, bytes_down=0, bytes_up=0) == 0.0


def test_a_deadline_cuts_the_clients_slower_than_it_and_the_round_lasts_until_it():
    clock = clock_of(4, step_seconds=Spread(value=1.0, sigma=0), deadline=5.0)
    timing = clock.settle([outcome(0, 2), outcome(1, 6), outcome(2, 5), outcome(3, 9)])
    assert sorted(timing.late) == [1, 3]  # 6 s and 9 s miss 5 s; 5 s makes it (<=)
    assert timing.seconds == 5.0
    kept = [o.cid for o in timing.outcomes if not o.dropped]
    assert kept == [0, 2] and all(o.upload is None and o.state is None for o in timing.outcomes if o.dropped)


def test_full_wait_lasts_as_long_as_the_slowest_client():
    clock = clock_of(3, step_seconds=Spread(value=0.25, sigma=0))
    timing = clock.settle([outcome(0, 4), outcome(1, 12), outcome(2, 8)])
    assert timing.late == [] and timing.seconds == 3.0


def test_over_selection_keeps_the_first_m_to_finish_and_ends_with_the_mth():
    clock = clock_of(8, fraction=0.25, step_seconds=Spread(value=1.0, sigma=0), over_selection=2.0)
    selection = clock.select(1, 0.0)
    assert len(selection.train) == 4  # ceil(2 x m), m = 2
    steps = dict(zip(selection.train, [7, 3, 9, 4], strict=True))
    timing = clock.settle([outcome(c, s) for c, s in steps.items()])
    kept = sorted(c for c, s in steps.items() if s in (3, 4))
    assert sorted(o.cid for o in timing.outcomes if not o.dropped) == kept
    assert timing.seconds == 4.0  # the second to finish


def test_over_selection_with_a_deadline_ends_at_the_mth_finisher_not_the_deadline():
    clock = clock_of(
        4, fraction=0.5, step_seconds=Spread(value=1.0, sigma=0), over_selection=2.0, deadline=100.0
    )
    timing = clock.settle([outcome(0, 3), outcome(1, 4), outcome(2, 50), outcome(3, 500)])
    assert timing.late == [2, 3] and timing.seconds == 4.0 and timing.steps == 7


def test_a_rejected_upload_takes_no_place_among_the_first_m():
    clock = clock_of(4, fraction=0.5, step_seconds=Spread(value=1.0, sigma=0), over_selection=2.0)
    rejected = ClientOutcome(cid=0, bytes_down=0, steps=0)  # no upload: reports at once, counts for nothing
    timing = clock.settle([rejected, outcome(1, 4), outcome(2, 5), outcome(3, 9)])
    kept = [o.cid for o in timing.outcomes if o.upload is not None]
    assert timing.late == [3] and timing.seconds == 5.0 and kept == [1, 2]


def test_a_round_nobody_trains_in_lasts_the_deadline_or_nothing():
    assert clock_of(3, deadline=7.0).settle([]).seconds == 7.0
    assert clock_of(3).settle([]).seconds == 0.0


def test_with_nobody_online_the_server_waits_for_the_next_hour_someone_is(tmp_path):
    text = "client,step_seconds,bytes_per_second,online\n" + "".join(
        f"{c},1,1000,{'0' * 3}1{'0' * 20}\n" for c in range(4)
    )
    cfg = ClockSection(availability="trace")
    clock = VirtualClock(
        cfg, ClientSpeeds.build(cfg, 0, [[1]] * 4, read_trace(write(tmp_path, text), 4)), 4, 0.5, 3, 0
    )
    selection = clock.select(1, 600.0)  # 00:10: nobody until 03:00
    assert selection.wait == 3 * 3600 - 600 and len(selection.train) == 2
    assert clock.settle([outcome(c, 2) for c in selection.train], selection).seconds == selection.wait + 2.0


def test_partial_work_fits_whole_steps_after_the_round_trip():
    clock = clock_of(
        2, step_seconds=Spread(value=0.3, sigma=0), bytes_per_second=Spread(value=100, sigma=0), deadline=2.0,
        late="partial",
    )  # fmt: skip
    # 2 s - 50 bytes / 100 B/s = 1.5 s of compute: 5 steps of 0.3 s (exactly, not 4 by rounding)
    assert clock.step_limit(0, comm_bytes=50) == 5
    assert clock.step_limit(0, comm_bytes=400) == 0  # the round trip alone misses the deadline
    selection = clock.select(1, 0.0, partial_bytes=400)
    assert selection.train == [] and selection.step_limits == {0: 0, 1: 0} and selection.no_time == [0, 1]
    assert clock.settle([], selection).late == [0, 1]  # reported late, not silently gone


def test_spreads_draw_what_they_say():
    rng = np.random.default_rng(0)
    from fedskew.engine.clock import draw

    logn = draw(Spread(distribution="lognormal", value=2.0, sigma=0.5), rng, 20000)
    assert abs(float(np.median(logn)) - 2.0) < 0.05 and abs(float(np.log(logn).std()) - 0.5) < 0.02
    uni = draw(Spread(distribution="uniform", low=1.0, high=3.0), rng, 20000)
    assert uni.min() >= 1.0 and uni.max() <= 3.0 and abs(float(uni.mean()) - 2.0) < 0.03
    assert (draw(Spread(value=7.0, sigma=0.0), rng, 3) == 7.0).all()


def test_slow_classes_slow_the_clients_that_mostly_hold_them():
    counts = [[9, 1], [1, 9], [5, 5], [0, 0]]
    assert mostly_in(counts, [1]).tolist() == [False, True, False, False]  # half is not most; empty is not
    cfg = ClockSection(step_seconds=Spread(value=0.1, sigma=0), slow_classes=[1], slow_factor=10)
    speeds = ClientSpeeds.build(cfg, 0, counts)
    assert speeds.step_seconds.tolist() == pytest.approx([0.1, 1.0, 0.1, 0.1])
    assert speeds.bytes_per_second[1] * 10 == pytest.approx(speeds.bytes_per_second[0])


# ---------------------------------------------------------------------------- who is sampled
@pytest.mark.parametrize(("n", "fraction", "seed"), [(10, 0.3, 0), (7, 1.0, 3), (50, 0.1, 11)])
def test_with_everyone_online_the_clock_samples_the_seeds_stream(n, fraction, seed):
    clock = clock_of(n, fraction=fraction, rounds=5, seed=seed)
    schedule = sampling_schedule(n, fraction, 5, seed)
    assert [clock.select(r, 0.0).train for r in range(1, 6)] == schedule.tolist()


def test_bernoulli_availability_samples_only_online_clients_and_is_seeded():
    clock = clock_of(40, fraction=0.25, availability="bernoulli", available=0.3)
    for r in (1, 2, 3):
        online = clock.online(r, 0.0)
        assert set(clock.select(r, 0.0).train) <= set(np.flatnonzero(online).tolist())
        assert (clock.online(r, 0.0) == online).all()  # a pure function of (seed, round)
    assert 0.1 < np.mean([clock.online(r, 0.0).mean() for r in range(1, 4)]) < 0.5


def test_diurnal_availability_follows_the_hour_of_the_virtual_day():
    trace = read_trace(EXAMPLE / "trace_example.csv", 20)
    cfg = ClockSection(availability="trace")
    clock = VirtualClock(cfg, ClientSpeeds.build(cfg, 0, [[1]] * 20, trace), 20, 0.5, 3, 0)
    for hour in (0, 7, 13, 23):
        now = hour * 3600.0 + 1800.0 + 24 * 3600.0  # mid-hour of the second day
        expected = [trace[c].online[hour] == "1" for c in range(20)]  # type: ignore[index]
        assert clock.online(1, now).tolist() == expected


def test_dropout_is_per_seed_round_and_client():
    clock = clock_of(200, dropout=0.2)
    lost = clock.select(1, 0.0).dropped_out
    assert 20 < len(lost) < 60 and lost == clock.select(1, 0.0).dropped_out
    assert not set(lost) & set(clock.select(1, 0.0).train)


# ---------------------------------------------------------------------------- trace files
def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("client,step_seconds,bytes_per_second\n6,0.1,1000\n", "unknown client 6; allowed: 0..5"),
        ("client,step_seconds,bytes_per_second\n-1,0.1,1000\n", "unknown client -1"),
        ("client,step_seconds,bytes_per_second\n1,0.1,1000\n1,0.2,1000\n", "client 1 is listed twice"),
        ("client,step_seconds,bytes_per_second\n1,0,1000\n", "must be > 0"),
        ("client,step_seconds,bytes_per_second\n1,nan,1000\n", "must be > 0"),
        ("client,step_seconds,bytes_per_second,online\n1,0.1,9,0101\n", "24 characters of 0/1"),
        ("client,speed\n1,0.1\n", "needs the header"),
        ("client,step_seconds,bytes_per_second,onlin\n1,0.1,9,1\n", "unknown: onlin"),
        ("client,step_seconds,bytes_per_second\n", "no client rows"),
        ("client,step_seconds,bytes_per_second\n1,0.1,9,7\n", "more values than"),
        ("client,step_seconds,bytes_per_second\n1,inf,9\n", "finite"),
        (
            "client,step_seconds,bytes_per_second\n\n1,0.1,9\n\n\n1,0.1,9\n",
            "line 6: client 1 is listed twice",
        ),
        ("client,step_seconds,bytes_per_second\nx,0.1,1000\n", "client must be an integer"),
    ],
)
def test_a_bad_trace_is_refused_in_one_line(tmp_path, text, problem):
    with pytest.raises(ConfigError, match=problem) as err:
        read_trace(write(tmp_path, text), 6)
    assert "\n" not in str(err.value)


def test_a_trace_written_by_a_spreadsheet_with_a_byte_order_mark_reads(tmp_path):
    path = tmp_path / "bom.csv"
    path.write_bytes("\ufeffclient,step_seconds,bytes_per_second\n3,0.5,10\n".encode())
    assert read_trace(path, 4)[3].step_seconds == 0.5


def test_a_trace_sets_the_listed_clients_and_leaves_the_others_drawn(tmp_path):
    trace = read_trace(write(tmp_path, "client,step_seconds,bytes_per_second\n2,0.7,123\n"), 4)
    cfg = ClockSection(step_seconds=Spread(value=0.1, sigma=0))
    speeds = ClientSpeeds.build(cfg, 0, [[1]] * 4, trace)
    assert speeds.step_seconds.tolist() == [0.1, 0.1, 0.7, 0.1] and speeds.bytes_per_second[2] == 123


# ---------------------------------------------------------------------------- end to end
def run(cfg: dict, rounds: int | None = None) -> tuple[list[dict], object]:
    sim = build_simulation(build_config(cfg))
    for _ in range(rounds or cfg["rounds"]):
        sim.run_round()
    return sim.history, sim


CLOCK_KEYS = {"virtual_time", "round_seconds", "late", "dropped_out", "round_steps", "round_uploads"}


def strip_clock(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in CLOCK_KEYS and not k.startswith("seconds")}


def test_full_wait_on_the_clock_is_bit_identical_to_no_clock():
    base = tiny_config("fedavg", rounds=3)
    plain, plain_sim = run(base)
    timed, timed_sim = run({**base, "clock": {"step_seconds": {"distribution": "lognormal", "value": 0.1}}})
    assert [strip_clock(r) for r in timed] == [strip_clock(r) for r in plain]
    pairs = zip(plain_sim.server["weights"].values(), timed_sim.server["weights"].values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    times = [r["virtual_time"] for r in timed]
    assert times == sorted(times) and times[0] > 0 and all(r["late"] == [] for r in timed)


def slow_deadline(cfg: dict) -> dict:
    """Clients mostly holding classes 0-4 get a 1000 times slower link: a 5 s deadline cuts exactly them."""
    return {**cfg, "clock": {"slow_classes": [0, 1, 2, 3, 4], "slow_factor": 1000.0, "deadline": 5.0}}


@pytest.mark.parametrize("name", NAMES)
def test_every_method_keeps_the_contract_with_a_deadline_and_empty_clients(name):
    """The contract suite's rules (``checked``) and the empty-client federation, with a deadline that cuts
    exactly the slow clients every round: nothing else is rejected, the others' updates make the model."""
    protocol = "personalized" if ALGORITHMS.get(name).requires_personalized_eval else "global"
    cfg = slow_deadline(empty_client_config(name, protocol, "sequential"))
    slow = set(
        np.flatnonzero(mostly_in(build_data(build_config(cfg)).class_counts().tolist(), range(5))).tolist()
    )
    assert slow and len(slow) < 12
    with ALGORITHMS.replaced(name, checked(ALGORITHMS.get(name))):
        history, _ = run(cfg)
    for record in history:
        # zero-shot methods neither train nor communicate: nobody takes time
        traffic = record["round_bytes_down"] + record["round_bytes_up"]
        moved = traffic > 0 or math.isfinite(record["train_loss"])
        assert set(record["late"]) == (slow if moved else set()) and record["rejected"] == 0
        assert record["round_seconds"] == (5.0 if moved else 0.0)
        assert math.isfinite(record["accuracy"])


def test_a_deadline_without_partial_work_drops_and_with_it_trains_fewer_steps():
    base = tiny_config("fednova", rounds=2)
    base["client"].update(fraction=1.0, epochs=3)
    clock = {"step_seconds": {"distribution": "lognormal", "value": 0.1, "sigma": 1.0}, "deadline": 2.0}
    dropped, _ = run({**base, "clock": clock})
    partial, _ = run({**base, "clock": {**clock, "late": "partial"}})
    waited, _ = run({**base, "clock": {k: v for k, v in clock.items() if k != "deadline"}})
    assert any(r["late"] for r in dropped)  # whole clients are lost ...
    assert all(r["late"] == [] for r in partial)  # ... where partial work keeps them, cut to fit
    assert all(r["round_seconds"] <= 2.0 for r in partial)
    assert partial[-1]["round_bytes_up"] > dropped[-1]["round_bytes_up"]
    for cut_short, whole in zip(partial, waited, strict=True):  # the same clients, fewer steps
        assert cut_short["round_bytes_up"] == whole["round_bytes_up"]
        assert 0 < cut_short["round_steps"] < whole["round_steps"]


def test_an_interrupted_run_on_the_clock_resumes_exactly(tmp_path):
    from fedskew.experiment.runner import run_experiment

    cfg = tiny_config("fedavg", rounds=4)
    cfg["clock"] = {
        "step_seconds": {"distribution": "lognormal", "value": 0.1}, "availability": "bernoulli",
        "available": 0.7, "dropout": 0.2, "deadline": 1.5,
    }  # fmt: skip
    run_experiment(build_config(cfg), tmp_path / "whole")
    with pytest.raises(StopRun):
        run_experiment(build_config(cfg), tmp_path / "cut", on_round=stop_after(2))
    run_experiment(build_config(cfg), tmp_path / "cut", resume=True)
    whole = run_metrics(tmp_path / "whole")
    assert run_metrics(tmp_path / "cut") == whole and whole[-1]["virtual_time"] > 0
    assert any(r["late"] or r["dropped_out"] for r in whole)  # the policies really acted


def test_a_federation_where_rounds_go_empty_runs_on_and_skips_them():
    cfg = tiny_config("fedavg", rounds=4)
    cfg["clock"] = {"dropout": 0.9}
    cfg["engine"]["max_skipped_share"] = 1.0
    history, sim = run(cfg)
    assert sim.skipped and all(r["round_seconds"] == 0.0 for r in history if r.get("skipped"))


def test_an_edited_trace_is_refused_on_resume(tmp_path):
    trace = write(tmp_path, "client,step_seconds,bytes_per_second\n1,0.1,1000\n")
    cfg = tiny_config("fedavg")
    cfg["clock"] = {"trace": str(trace)}
    recorded = build_config(cfg).to_dict()
    assert recorded["clock"]["trace_sha256"]
    trace.write_text("client,step_seconds,bytes_per_second\n1,0.5,1000\n")
    with pytest.raises(ConfigError, match="changed since the run recorded it"):
        build_config(recorded)


def test_the_example_trace_config_runs_and_drops_late_clients():
    cfg = build_config(
        __import__("yaml").safe_load((EXAMPLE / "digits-trace.yaml").read_text()), ["rounds=3"], base=EXAMPLE
    )
    sim = build_simulation(cfg)
    records = [sim.run_round().record for _ in range(3)]
    assert records[-1]["virtual_time"] == pytest.approx(sum(r["round_seconds"] for r in records))
    assert any(r["late"] for r in records)


# ---------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    ("over", "problem"),
    [
        (["clock.deadline=0"], "clock.deadline"),
        (["clock.deadline=-3"], "clock.deadline"),
        (["clock.late=partial"], "'partial' needs clock.deadline"),
        (["clock.deadline=2", "clock.late=partial"], "does not declare partial_work"),
        (["clock.availability=trace"], "'trace' needs clock.trace"),
        (["clock.over_selection=0.5"], "clock.over_selection"),
        (
            ["clock.aggregation=fedbuff", "algorithm.name=fedproto", "eval.protocol=personalized"],
            "does not aggregate by a mean",
        ),
        (["engine.runtime=flower-simulation"], "runs in the embedded engine"),
        (["clock.over_selection=.inf"], "clock.over_selection"),
        (["clock.step_seconds.value=.inf"], "clock.step_seconds.value"),
        (["clock.slow_classes=[-1]"], "clock.slow_classes"),
        (["clock.buffer=3"], "'clock.buffer': read only by clock.aggregation"),
        (["clock.available=0.5"], "'clock.available': read only"),
    ],
)
def test_bad_clock_input_is_one_line(over, problem):
    cfg = tiny_config("fedavg")
    cfg["clock"] = {}
    with pytest.raises(ConfigError, match=problem) as err:
        build_config(cfg, over)
    assert "\n" not in str(err.value)


def test_the_cli_refuses_a_trace_with_unknown_clients_with_exit_2(tmp_path, monkeypatch, capsys):
    from tests.conftest import cli

    trace = write(tmp_path, "client,step_seconds,bytes_per_second\n99,0.1,1000\n")
    config = tmp_path / "c.yaml"
    cfg = tiny_config("fedavg", rounds=1)
    cfg["clock"] = {"trace": str(trace)}
    config.write_text(__import__("yaml").safe_dump(cfg))
    code, _, err = cli(["run", str(config), "--out", str(tmp_path / "out")], monkeypatch, capsys)
    assert code == 2 and "unknown client 99; allowed: 0..5" in err
    code, _, err = cli(["run", str(config), "--out", str(tmp_path / "o2"), "--set", "clock.deadline=0"],
                       monkeypatch, capsys)  # fmt: skip
    assert code == 2 and "clock.deadline" in err
    fedbuff = [
        "--set",
        "clock.aggregation=fedbuff",
        "--set",
        "algorithm.name=fedproto",
        "--set",
        "eval.protocol=personalized",
    ]
    code, _, err = cli(["run", str(config), "--out", str(tmp_path / "o3"), *fedbuff], monkeypatch, capsys)
    assert code == 2 and "does not aggregate by a mean" in err and len(err.strip().splitlines()) == 1


def test_slow_classes_outside_the_dataset_and_a_trace_without_online_column_are_refused(tmp_path):
    cfg = tiny_config("fedavg")
    cfg["clock"] = {"slow_classes": [10]}
    with pytest.raises(ConfigError, match="class 10 is not one of digits's 10 classes; allowed: 0..9"):
        build_simulation(build_config(cfg))
    cfg["clock"] = {
        "availability": "trace",
        "trace": str(write(tmp_path, "client,step_seconds,bytes_per_second\n1,1,1\n")),
    }
    with pytest.raises(ConfigError, match="'trace' needs an online column"):
        build_simulation(build_config(cfg))


@pytest.mark.parametrize("aggregation", ["sync", "fedbuff"])
def test_a_recorded_clock_config_builds_again(aggregation):
    """A run's config.yaml repeats every default; building it again (resume, sweep workers) must not read the
    defaults as keys the user set."""
    cfg = tiny_config("fedavg")
    cfg["clock"] = {"aggregation": aggregation}
    recorded = build_config(cfg).to_dict()
    assert build_config(recorded).to_dict() == recorded
