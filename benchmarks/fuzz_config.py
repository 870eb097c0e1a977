"""Config and CLI fuzzing: hypothesis-generated configs and ``--set`` overrides through ``fedskew run``.

Each example starts from a valid config and applies one to three mutations: a key of the schema set to a
value of another type, out of range, huge, non-finite or unicode; an unknown key at any depth; a section
replaced by a scalar; a ``--set`` with a random key path or value or no ``=``; or the whole file replaced by
an empty file, YAML that is not a mapping, invalid YAML or bytes that are not UTF-8. The CLI's ``main`` runs
it in this process with the run replaced by its checks up to the partition (dataset, partition feasibility,
device, per-client model options), so an example costs milliseconds. A rejection must be one line on stderr,
exit code 2, naming the key (or the file) and the allowed values; anything else (a traceback, another exit
code, a vague line) is a failure.

    python benchmarks/fuzz_config.py              # 1,000 examples (benchmarks/faults.py runs it too)
    python benchmarks/fuzz_config.py --quick      # 100
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedskew.experiment import runner
from fedskew.experiment.config import Config

BASE: dict[str, Any] = {
    "seed": 0,
    "rounds": 2,
    "data": {"dataset": "digits", "num_clients": 5, "partition": {"name": "dirichlet", "alpha": 0.5}},
    "model": {"name": "mlp_mpfedcl", "hidden": 32, "embed_dim": 16},
    "algorithm": {"name": "fedprox", "mu": 0.01},
    "client": {"epochs": 1, "batch_size": 16, "lr": 0.05},
}
#: words a rejection uses to give the allowed values
ALLOWED_WORDS = ("allowed", "valid", "expected", "should be", "must", "did you mean", "exceed", "need")
#: how a rejection names what it rejects: a config key, a --set, the file, or a registry / partition name
NAMING_WORDS = ("config key '", "--set '", "config file '", "config must be", "unknown ", "partition '")


def _paths(node: Any, prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    if isinstance(node, dict):
        if prefix:
            yield prefix
        for k, v in node.items():
            yield from _paths(v, (*prefix, str(k)))
    else:
        yield prefix


RESOLVED = Config.model_validate(BASE).to_dict()
KEYS = sorted(set(_paths(RESOLVED)) | set(_paths(BASE)))

weird_text = st.text(min_size=0, max_size=12) | st.sampled_from(
    ["", " ", "é∑😀", "..", "/etc/passwd", "1e999", "0x10"]
)
values = st.one_of(
    weird_text,
    st.integers(min_value=-(10**30), max_value=10**30),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 10**100, -(10**100)]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.lists(st.integers(-3, 3), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(-3, 3), max_size=2),
)
keys = st.sampled_from(KEYS)
new_key = st.text(min_size=1, max_size=8).filter(lambda s: "." not in s and "=" not in s)


@st.composite
def mutated(draw: st.DrawFn) -> tuple[bytes, list[str], str]:
    """``(file bytes, --set assignments, what was done)``."""
    whole = draw(st.integers(0, 9))
    if whole == 0:  # the file itself is not a config mapping
        raw = draw(
            st.sampled_from(
                [b"", b"[]", b"- 1\n- 2\n", b"42\n", b"'text'\n", b"a: [\n", b"\xff\xfe\x00bad", b"::\n"]
            )
            | st.text(max_size=30).map(lambda s: s.encode())
        )
        return raw, [], f"file {raw[:30]!r}"
    cfg = copy.deepcopy(BASE)
    what, sets = [], []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["value", "unknown", "section", "set", "set-raw", "delete"]))
        path = draw(keys)
        if kind == "value":
            _put(cfg, path, draw(values))
        elif kind == "unknown":
            path = (*path[:-1], draw(new_key))
            _put(cfg, path, draw(values))
        elif kind == "section":
            path = path[:1]
            cfg[path[0]] = draw(values)
        elif kind == "delete":
            _delete(cfg, path)
        elif kind == "set":
            value = draw(
                weird_text | values.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip())
            )
            sets.append(f"{'.'.join(path)}={value}")
        else:
            sets.append(draw(st.text(max_size=20)))
        what.append(f"{kind} {'.'.join(path)}")
    text = yaml.safe_dump(cfg, allow_unicode=True)
    return text.encode(), sets, "; ".join(what)


def _put(cfg: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    node: Any = cfg
    for part in path[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[path[-1]] = value


def _delete(cfg: dict[str, Any], path: tuple[str, ...]) -> None:
    node: Any = cfg
    for part in path[:-1]:
        node = node.get(part) if isinstance(node, dict) else None
    if isinstance(node, dict):
        node.pop(path[-1], None)


# ---------------------------------------------------------------------------- one example
def dry_run(cfg: Any, out: Any = None, **_: Any) -> dict[str, Any]:
    """What ``fedskew run`` checks before its first round: device, dataset and partition, model options."""
    runner.with_resolved_device(cfg)
    runner.build_data(cfg)
    runner.model_options(cfg)
    return {"final": {"accuracy": 0.0}, "rounds": 0, "wall_seconds": 0.0}


@contextlib.contextmanager
def dry_runs() -> Iterator[None]:
    real = runner.run_experiment
    runner.run_experiment = dry_run  # type: ignore[assignment]
    try:
        yield
    finally:
        runner.run_experiment = real


@dataclass
class Outcome:
    code: Any
    err: str
    what: str

    @property
    def clear(self) -> bool:
        """Accepted, or rejected with exit 2 and one line naming a key or the file and the allowed values."""
        if self.code == 0:
            return True
        lines = [x for x in self.err.splitlines() if x.strip() and not x.startswith("WARNING ")]
        if self.code != 2 or len(lines) != 1 or "Traceback" in self.err:
            return False
        line = lines[0]
        names = any(w in line for w in NAMING_WORDS)
        return names and any(w in line.lower() for w in ALLOWED_WORDS)


def check_one(work: Path, raw: bytes, sets: list[str], what: str) -> Outcome:
    from benchmarks.cli_calls import run_cli

    path = work / "fuzz.yaml"
    path.write_bytes(raw)
    args = ["run", str(path), "--out", str(work / "out"), "--force"]
    for s in sets:
        args += ["--set", s]
    code, err = run_cli(*args)
    return Outcome(code, err, what)


@dataclass
class FuzzResult:
    examples: int = 0
    accepted: int = 0
    rejected: int = 0
    tracebacks: int = 0
    unclear: list[Outcome] = field(default_factory=list)

    @property
    def failures(self) -> int:
        return len(self.unclear)

    def table(self) -> str:
        cells = [self.examples, self.accepted, self.rejected, self.tracebacks, len(self.unclear)]
        return "\n".join(
            [
                "| inputs fuzzed | accepted | rejected: one line, exit 2 | tracebacks | unclear rejections |",
                "|---:|---:|---:|---:|---:|",
                "| " + " | ".join(str(c) for c in cells) + " |",
            ]
        )


def fuzz_campaign(examples: int) -> FuzzResult:
    """Run ``examples`` fuzzed configs through ``fedskew run`` (derandomized: the same examples every
    time); counts and the unclear rejections."""
    result = FuzzResult()
    with tempfile.TemporaryDirectory(prefix="fedskew-fuzz-") as tmp, dry_runs():
        work = Path(tmp)

        @settings(
            max_examples=examples,
            deadline=None,
            database=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        @given(mutated())
        def one(example: tuple[bytes, list[str], str]) -> None:
            out = check_one(work, *example)
            result.examples += 1
            result.accepted += out.code == 0
            result.rejected += out.code == 2 and out.clear
            result.tracebacks += "Traceback" in out.err
            if not out.clear:
                result.unclear.append(out)

        one()
    return result


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=None, help="fuzzed configs (default 1000, --quick 100)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    res = fuzz_campaign(args.examples or (100 if args.quick else 1000))
    print(res.table())
    for o in res.unclear[:50]:
        print(f"UNCLEAR [{o.what}] exit {o.code}: {o.err.strip()[-400:]}")


if __name__ == "__main__":
    main()
