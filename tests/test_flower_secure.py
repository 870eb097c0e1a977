"""``flower-deployment`` is secure by default (issue 51, item 3): the local SuperLink serves over TLS with a
certificate made for the run and accepts only SuperNodes whose keys it registered; ``engine.insecure: true``
is the one way back to Flower's ``--insecure``. A real deployment of one node: the processes' command lines
say how they were started. (Runs through ``fedskew run`` on the default, secure deployment are the other
deployment tests: tests/test_threads.py, tests/test_plugins.py.)"""

from __future__ import annotations

import pytest

pytest.importorskip("flwr")

from fedskew.flower.deploy import LocalDeployment

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
