"""``flower-deployment`` is secure by default (issue 51, item 3): the local SuperLink serves over TLS with a
certificate made for the run and accepts only SuperNodes whose keys it registered; ``engine.insecure: true``
is the one way back to Flower's ``--insecure``. A real deployment of one node: the processes' command lines
say how they were started, and a run through ``fedskew run`` on the default deployment trains."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("flwr")

from fedskew.experiment.config import build_config
from fedskew.flower.deploy import LocalDeployment, run_deployment
from tests.conftest import digits_config

pytestmark = [pytest.mark.slow]


def test_a_default_deployment_serves_tls_and_authenticates_every_node():
    with LocalDeployment(1) as dep:
        link = [str(a) for a in dep.procs["superlink"].args]
        node = [str(a) for a in dep.procs["supernode-0"].args]
        assert "--insecure" not in link and "--insecure" not in node
        served = {"--ssl-certfile", "--ssl-keyfile", "--ssl-ca-certfile", "--enable-supernode-auth"}
        assert served <= set(link)
        assert {"--root-certificates", "--auth-supernode-private-key"} <= set(node)
        assert dep.tls is not None and dep.tls.cert.is_file() and len(dep.registered) == 1
        home = dep.home
    assert not home.exists()  # the run's keys and certificates go with the deployment


def test_insecure_is_an_explicit_choice():
    with LocalDeployment(1, insecure=True) as dep:
        assert "--insecure" in dep.procs["superlink"].args and "--insecure" in dep.procs["supernode-0"].args
        assert "--enable-supernode-auth" not in dep.procs["superlink"].args


def test_a_run_on_the_default_deployment_trains_and_records_no_security_switch(tmp_path):
    cfg = digits_config(rounds=1, engine={"runtime": "flower-deployment", "nodes": 2, "mode": "sequential"})
    summary = run_deployment(build_config(cfg), tmp_path / "run", resume=False, force=False)
    assert summary["final"]["accuracy"] > 0.1
    recorded = json.loads(json.dumps(summary))
    assert recorded["status"] == "finished"
