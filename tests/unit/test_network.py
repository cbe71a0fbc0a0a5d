"""What a node advertises and which interface it pins before a multi-node launch
(workbench/launch/network.py), and the rendezvous-timeout line (workbench/launch/torchrun.py).
Across real nodes: tests/cluster/."""

from __future__ import annotations

import os

import pytest

from tests.conftest import compose
from workbench.core.errors import UserError
from workbench.launch import network, torchrun


def clean_env(monkeypatch) -> None:
    """Unset the variables `prepare` sets, so that monkeypatch removes them again after the test
    (setenv first: a plain delenv of an unset name records nothing to undo, and a leaked
    GLOO_SOCKET_IFNAME would send later gloo tests to an interface this machine lacks)."""
    for var in (*network.IFNAME_VARS, "WORKBENCH_NODE_ADDR"):
        monkeypatch.setenv(var, "unset")
        monkeypatch.delenv(var)


def test_an_endpoint_without_a_port_names_the_field():
    with pytest.raises(UserError, match=r"hardware.rdzv_endpoint='head': expected host:port"):
        network.split_endpoint("head")


def test_a_host_that_does_not_resolve_is_one_line_naming_the_field():
    with pytest.raises(UserError, match=r"hardware.rdzv_endpoint: 'no-such-host.invalid' does not resolve on "):
        network.route_to("no-such-host.invalid", 29400)


def test_every_rank_on_this_machine_pins_nothing(monkeypatch):
    clean_env(monkeypatch)
    assert network.prepare("127.0.0.1:29400") is None
    assert network.prepare("localhost:29400") is None
    assert not any(v in os.environ for v in (*network.IFNAME_VARS, "WORKBENCH_NODE_ADDR"))


def test_a_node_reached_by_its_own_name_on_loopback_advertises_its_outward_interface(monkeypatch):
    """Debian puts a node's hostname on 127.0.1.1: the rendezvous host must still advertise the
    address the other nodes reach it at, and pin gloo to that interface."""
    clean_env(monkeypatch)
    monkeypatch.setattr(network, "route_to", lambda host, port, field: network.Route(host, port, "127.0.1.1", "lo"))
    monkeypatch.setattr(network, "outward", lambda field: ("10.1.2.3", "ens5"))
    route = network.prepare("n1:29400")
    assert (route.address, route.ifname) == ("10.1.2.3", "ens5")
    env = os.environ
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "ens5" and env["WORKBENCH_NODE_ADDR"] == "10.1.2.3"


def test_an_exported_interface_wins(monkeypatch):
    clean_env(monkeypatch)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    monkeypatch.setattr(network, "route_to", lambda host, port, field: network.Route(host, port, "10.1.2.3", "ens5"))
    network.prepare("10.1.2.1:29400")
    env = os.environ
    assert env["GLOO_SOCKET_IFNAME"] == "ib0" and env["NCCL_SOCKET_IFNAME"] == "ens5"


def test_a_rendezvous_that_timed_out_names_the_node_it_waited_for():
    cfg = compose(["hardware.nodes=2", "hardware.node_rank=0", "hardware.rdzv_endpoint=10.1.2.1:29400",
                   "hardware.rdzv_timeout_s=60"], validate=False)
    config = torchrun.launch_config(cfg, network.Route("10.1.2.1", 29400, "10.1.2.1", "ens5"))
    assert config.rdzv_configs["join_timeout"] == 60 and config.local_addr == "10.1.2.1"
    line = torchrun._waited(cfg, config, network.Route("10.1.2.1", 29400, "10.1.2.1", "ens5"))
    assert "incomplete after 60 s (hardware.rdzv_timeout_s): node_rank 1 never joined" in line
    assert "10.1.2.1 (ens5)" in line


def test_min_nodes_lets_the_rendezvous_close_with_fewer_nodes():
    cfg = compose(["hardware.nodes=2", "hardware.min_nodes=1", "hardware.rdzv_endpoint=10.1.2.1:29400"],
                  validate=False)
    config = torchrun.launch_config(cfg)
    assert (config.min_nodes, config.max_nodes) == (1, 2)
