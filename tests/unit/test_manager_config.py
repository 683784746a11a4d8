"""resolve_config: every Manager argument and variable, and one clear line for each mistake."""

# One row per mistake reads best on one line, however long its expected text.
# ruff: noqa: E501

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from torchft_like.manager.config import ManagerConfig, ManagerConfigError, resolve_config

TORCHRUN = {"MASTER_ADDR": "vm", "MASTER_PORT": "29500", "RANK": "0", "WORLD_SIZE": "2"}
LIGHTHOUSE = {"TORCHFT_LIGHTHOUSE": "http://lighthouse:29510"}


def resolve(environ: dict[str, Any], **arguments: Any) -> ManagerConfig:
    return resolve_config(**arguments, environ=environ, machine_name=lambda: "this-machine")


# fmt: off
@pytest.mark.parametrize(
    "environ, arguments, expected",
    [
        ({"TORCHFT_MANAGER_PORT": "abc"}, {}, "TORCHFT_MANAGER_PORT='abc' is not a port number; set TORCHFT_MANAGER_PORT to"),
        ({"TORCHFT_QUORUM_RETRIES": "x"}, {}, "TORCHFT_QUORUM_RETRIES='x' is not an integer; set TORCHFT_QUORUM_RETRIES to"),
        ({"TORCHFT_QUORUM_RETRIES": "-1"}, {}, "TORCHFT_QUORUM_RETRIES='-1' must be at least 0"),
        ({"TORCHFT_MANAGER_PORT": "99999"}, {}, "TORCHFT_MANAGER_PORT='99999' is out of range: a port is 0-65535"),
        ({}, {"port": "abc"}, "port='abc' is not a port number; pass port as"),
        ({}, {"port": 70000}, "port=70000 is out of range: a port is 0-65535; pass port as"),
        ({"MASTER_PORT": "http"}, {}, "MASTER_PORT='http' is not a port number"),
        ({}, {"store_port": -1}, "store_port=-1 is out of range: a port is 0-65535"),
        ({}, {"metrics_port": 65536}, "metrics_port=65536 is out of range"),
        ({"TORCHFT_QUORUM_TIMEOUT_SEC": "-1"}, {}, "TORCHFT_QUORUM_TIMEOUT_SEC='-1' must be a positive, finite duration; set TORCHFT_QUORUM_TIMEOUT_SEC to a positive number of seconds"),
        ({"TORCHFT_TIMEOUT_SEC": "0"}, {}, "TORCHFT_TIMEOUT_SEC='0' must be a positive"),
        ({"TORCHFT_CONNECT_TIMEOUT_SEC": "inf"}, {}, "TORCHFT_CONNECT_TIMEOUT_SEC='inf' must be a positive, finite"),
        ({"TORCHFT_TIMEOUT_SEC": "1m"}, {}, "TORCHFT_TIMEOUT_SEC='1m' is not a number of seconds"),
        ({}, {"timeout": 0}, "timeout=0 must be a positive, finite duration; pass timeout as a positive number of seconds or a timedelta"),
        ({}, {"quorum_timeout": -30.0}, "quorum_timeout=-30.0 must be a positive"),
        ({}, {"connect_timeout": timedelta(seconds=-1)}, "connect_timeout=datetime.timedelta(days=-1, seconds=86399) must be a positive"),
        ({}, {"timeout": "30"}, "timeout='30' is a str, not a duration; pass timeout as a positive"),
        ({}, {"heartbeat_interval": None}, "heartbeat_interval=None is a NoneType, not a duration"),
        ({}, {"rank": 3, "world_size": 2}, "rank=3 is not in [0, world_size=2): a rank counts from 0"),
        ({"RANK": "2"}, {}, "RANK='2' is not in [0, WORLD_SIZE=2)"),
        ({"RANK": "-1"}, {}, "RANK='-1' is not in [0, WORLD_SIZE=2)"),
        ({"RANK": "first"}, {}, "RANK='first' is not an integer; set RANK to"),
        ({"WORLD_SIZE": "0"}, {}, "WORLD_SIZE='0' must be at least 1"),
        ({"MASTER_PORT": None}, {}, "MASTER_PORT is not set: torchrun sets MASTER_ADDR and MASTER_PORT (the group's TCPStore); outside torchrun set both, or pass store_addr and store_port"),
        ({"TORCHFT_LIGHTHOUSE": "grpc://h:1"}, {}, "TORCHFT_LIGHTHOUSE='grpc://h:1': the scheme must be http:// or https:// (https only with TLS); set TORCHFT_LIGHTHOUSE to"),
        ({}, {"lighthouse_addr": "dns:///h:1"}, "lighthouse_addr='dns:///h:1': the scheme must be http:// or https://"),
        ({"TORCHFT_LIGHTHOUSE": None}, {}, "no lighthouse address: pass lighthouse_addr or set TORCHFT_LIGHTHOUSE"),
        ({"TORCHFT_LIGHTHOUSE": "http://localhost"}, {}, "lighthouse address (TORCHFT_LIGHTHOUSE or lighthouse_addr) 'http://localhost' has no valid port"),
        ({"TORCHFT_LIGHTHOUSE": "https://h:1"}, {}, "'https://h:1' is https but this process has no TLS configuration"),
        ({}, {"min_replica_size": 0}, "min_replica_size (0) must be at least 1"),
        ({}, {"heal_sources": 0}, "heal_sources (0) must be at least 1"),
        ({"TORCHFT_HEAL_SOURCES": "none"}, {}, "TORCHFT_HEAL_SOURCES='none'"),
        ({}, {"fingerprint_interval": 0}, "fingerprint_interval=0 must be at least 1; pass fingerprint_interval as"),
        ({"TORCHFT_LIKE_FINGERPRINT_INTERVAL": "often"}, {}, "TORCHFT_LIKE_FINGERPRINT_INTERVAL='often' is not an integer; set TORCHFT_LIKE_FINGERPRINT_INTERVAL to"),
        ({"TORCHFT_LIKE_CONTROL_SCHED": "idle"}, {}, "TORCHFT_LIKE_CONTROL_SCHED='idle' is not a policy; set it to batch (the default: the Manager's threads never preempt training) or normal"),
    ],
)
# fmt: on
def test_each_mistake_is_one_line_naming_the_argument_or_variable(environ, arguments, expected):
    merged = {k: v for k, v in {**TORCHRUN, **LIGHTHOUSE, **environ}.items() if v is not None}
    with pytest.raises(ValueError) as e:
        resolve(merged, **arguments)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)


def test_defaults_come_from_torchruns_environment():
    config = resolve({**TORCHRUN, **LIGHTHOUSE, "RANK": "1", "TORCHELASTIC_RESTART_COUNT": "3"})
    assert (config.rank, config.world_size) == (1, 2)
    assert (config.store_addr, config.store_port) == ("vm", 29500)
    assert config.store_prefix == "torchft/3/"
    assert config.hostname == "this-machine"
    assert config.timeout == config.quorum_timeout == timedelta(seconds=60)
    assert config.connect_timeout == timedelta(seconds=60)
    assert (config.port, config.quorum_retries, config.secret, config.tls) == (0, 0, None, None)


def test_arguments_win_over_the_environment_except_timeouts_and_quorum_retries():
    environ = {
        **TORCHRUN,
        **LIGHTHOUSE,
        "TORCHFT_TIMEOUT_SEC": "7.5",
        "TORCHFT_QUORUM_RETRIES": "4",
        "TORCHFT_MANAGER_PORT": "1234",
        "TORCHFT_HOSTNAME": "from-env",
    }
    config = resolve(
        environ, timeout=1, quorum_retries=1, port=99, hostname="given", rank=1, world_size=3
    )
    assert (config.timeout, config.quorum_retries) == (timedelta(seconds=7.5), 4)
    assert (config.port, config.hostname, config.rank, config.world_size) == (99, "given", 1, 3)


@pytest.mark.parametrize(
    "given, seconds", [(30, 30.0), (0.25, 0.25), (timedelta(minutes=2), 120.0)]
)
def test_a_timeout_is_a_timedelta_or_a_number_of_seconds(given, seconds):
    config = resolve({**TORCHRUN, **LIGHTHOUSE}, timeout=given, heartbeat_interval=given)
    assert config.timeout == config.heartbeat_interval == timedelta(seconds=seconds)


def test_fingerprints_can_be_turned_on_from_the_environment():
    # A framework builds the Manager (torchtitan, Ray Train): the variable is
    # the user's only way in; an argument still wins.
    environ = {**TORCHRUN, **LIGHTHOUSE, "TORCHFT_LIKE_FINGERPRINT_INTERVAL": "5"}
    assert resolve(environ).fingerprint_interval == 5
    assert resolve(environ, fingerprint_interval=2).fingerprint_interval == 2
    assert resolve({**TORCHRUN, **LIGHTHOUSE}).fingerprint_interval is None


@pytest.mark.parametrize(
    "value, policy", [(None, "batch"), ("", "batch"), ("normal", "normal"), (" Normal ", "normal")]
)
def test_the_control_threads_policy_comes_from_the_environment(value, policy):
    environ = {**TORCHRUN, **LIGHTHOUSE}
    if value is not None:
        environ["TORCHFT_LIKE_CONTROL_SCHED"] = value
    assert resolve(environ).control_sched == policy


def test_only_group_rank_zero_needs_the_lighthouse():
    config = resolve({**TORCHRUN, "RANK": "1"})
    assert config.lighthouse_addr is None


def test_an_empty_variable_is_unset_and_a_bare_host_port_lighthouse_is_accepted():
    environ = {**TORCHRUN, "TORCHFT_MANAGER_PORT": "", "TORCHFT_TIMEOUT_SEC": " "}
    config = resolve({**environ, "TORCHFT_LIGHTHOUSE": "lighthouse:29510"})
    assert (config.port, config.timeout) == (0, timedelta(seconds=60))
    assert config.lighthouse_addr == "lighthouse:29510"


def test_torchfts_tests_may_give_master_port_as_an_int():
    assert resolve({**TORCHRUN, **LIGHTHOUSE, "MASTER_PORT": 29501}).store_port == 29501


def test_a_config_built_by_hand_is_checked_too():
    with pytest.raises(ManagerConfigError, match=r"rank \(2\) must be in \[0, world_size\)"):
        ManagerConfig(store_port=1, hostname="h", rank=2, world_size=2)
    with pytest.raises(ManagerConfigError, match=r"control_sched \('fifo'\) must be one of"):
        ManagerConfig(store_port=1, hostname="h", control_sched="fifo")
