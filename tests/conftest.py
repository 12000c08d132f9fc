"""Test tiers, and the guard that keeps them honest.

`distributed` marks every test that starts several processes: ranks through run_distributed, `tptrain train` or
torchrun as subprocesses, ranks started by hand. The fast tier leaves them (and `slow` ones) out:

    ./test.sh -m "not distributed and not slow"

A test without the marker that starts processes fails at once, saying so, so no test can be missing it: while it
runs, starting a multiprocessing process (run_distributed, torch's launchers in this process), a subprocess that is
a launcher (`tptrain train`, torchrun), or a second subprocess while one it started is still running, raises.

The shared fixtures: `checkpoints` (and `checkpoint`, for a module with one) writes what the test module declares as
CHECKPOINTS (a tests.helpers.checkpoints.Checkpoints) once a session, shared by the modules naming the same object.
"""
from __future__ import annotations

import collections
import multiprocessing.process
import os
import subprocess

import pytest

from tests.helpers import ranks

_LAUNCHERS = {"torchrun", "torch.distributed.run"}
_started: list[subprocess.Popen] = []  # the subprocesses the current test started


def _argv(args) -> list[str]:
    if isinstance(args, str):  # a command line (shell=True) or a lone program
        return args.split()
    return [os.fsdecode(a) for a in ([args] if isinstance(args, (bytes, os.PathLike)) else args)]


def _is_launcher(args) -> bool:
    names = [os.path.basename(a) for a in _argv(args)]
    return bool(_LAUNCHERS & set(names)) or any(a == "tptrain" and b == "train" for a, b in zip(names, names[1:]))


_popen_init = subprocess.Popen.__init__
_process_start = multiprocessing.process.BaseProcess.start


def _guarded_popen_init(self, args, *rest, **kwargs):
    if ranks.current_test_is_distributed is False:
        if _is_launcher(args):
            ranks.require_distributed_marker(f"`{' '.join(_argv(args))}`")
        if any(p.poll() is None for p in _started):
            ranks.require_distributed_marker("a second subprocess while its first still runs")
    _popen_init(self, args, *rest, **kwargs)
    _started.append(self)


def _guarded_process_start(self):
    ranks.require_distributed_marker(f"multiprocessing ({type(self).__name__} {self.name})")
    return _process_start(self)


def pytest_collection_modifyitems(session, config, items):
    """Files with the most multi-process tests first, single-process files last (each file's order kept): ./test.sh's
    two pytest processes (pytest-xdist) take whole files in this order, so the long files start early and the short
    ones fill the end instead of one process finishing a long file alone."""
    weight = collections.Counter(item.path for item in items if item.get_closest_marker("distributed"))
    order = {path: i for i, path in enumerate(dict.fromkeys(item.path for item in items))}
    items.sort(key=lambda item: (-weight[item.path], order[item.path]))


def pytest_configure(config):
    subprocess.Popen.__init__ = _guarded_popen_init
    multiprocessing.process.BaseProcess.start = _guarded_process_start


def pytest_unconfigure(config):
    subprocess.Popen.__init__ = _popen_init
    multiprocessing.process.BaseProcess.start = _process_start


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Setup (fixtures included), call and teardown of `item` run knowing whether it is marked."""
    ranks.current_test_is_distributed = item.get_closest_marker("distributed") is not None
    _started.clear()
    try:
        return (yield)
    finally:
        ranks.current_test_is_distributed = None
        _started.clear()


@pytest.fixture(autouse=True, scope="session")
def _data_cache(tmp_path_factory):
    """The token cache of every test (and of the `tptrain` processes they start) in a temporary directory,
    never the user's ~/.cache (nor a $TPTRAIN_CACHE of theirs)."""
    os.environ["TPTRAIN_CACHE"] = str(tmp_path_factory.mktemp("data-cache"))
    yield


@pytest.fixture(scope="session")
def _written(tmp_path_factory) -> dict:
    """{a module's CHECKPOINTS: what its write gave}, for the session."""
    return {}


@pytest.fixture(scope="module")
def checkpoints(request, _written, tmp_path_factory):
    """{name: directory, or (directory, reference)} of the module's CHECKPOINTS (tests.helpers.checkpoints)."""
    spec = request.module.CHECKPOINTS
    if spec not in _written:
        _written[spec] = spec.write(tmp_path_factory)
    return _written[spec]


@pytest.fixture(scope="module")
def checkpoint(checkpoints):
    """The one checkpoint of a module whose CHECKPOINTS names one."""
    (only,) = checkpoints.values()
    return only
