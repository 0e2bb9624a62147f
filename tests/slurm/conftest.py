"""The Slurm tests' fixtures: the session's real single-machine Slurm cluster (slurm_cluster.py)
beside the loopback sshd lab of tests/conftest.py, and each test's view of it with its node in
service."""
from __future__ import annotations

import warnings

import pytest

import slurm_cluster


@pytest.fixture(scope="session")
def slurm_session(lab, tmp_path_factory):
    """A real single-machine Slurm cluster (slurm_cluster.py: munged, slurmctld, one slurmd
    with 2 gpu GRES on character devices, partition `gpu`) and its login node: a loopback sshd
    host `login` of the lab. Skipped, with the reason, where slurm-wlm cannot run (not installed,
    not root)."""
    why = slurm_cluster.missing()
    if why:
        pytest.skip(why)
    cluster = slurm_cluster.SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        login = lab.hosts.get("login") or lab.add_host("login")
        yield cluster, login
    finally:
        cluster.close()


@pytest.fixture
def slurm_lab(slurm_session):
    """The session's Slurm cluster and login node (slurm_session), its node in service when the
    test begins: a node that an earlier test's job left drained or down (a step slurmd could not
    kill: "Kill task failed") is resumed, and a warning names the state and Slurm's reason."""
    cluster, _ = slurm_session
    found = cluster.heal()
    if found:
        warnings.warn(f"slurm lab: before this test, {found}", stacklevel=1)
    return slurm_session
