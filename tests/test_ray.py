"""--engine ray on a local Ray cluster the test starts (2 CPUs): byte-identical to the local engine."""

from __future__ import annotations

import filecmp

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")

from conftest import PARALLEL  # noqa: E402

from packer import BuildConfig, build  # noqa: E402


@pytest.fixture(scope="module")
def local_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    yield
    ray.shutdown()


def test_ray_engine_is_byte_identical(tmp_path, local_cluster, parallel_reference):
    local, on_ray = parallel_reference, tmp_path / "ray"
    build(BuildConfig(out=str(on_ray), engine="ray", **PARALLEL))
    names = sorted(p.name for p in local.iterdir())
    assert names == sorted(p.name for p in on_ray.iterdir())
    assert sum(n.startswith("shard-") for n in names) > 1  # the shards were written by parallel tasks
    for name in names:
        assert filecmp.cmp(local / name, on_ray / name, shallow=False), name
