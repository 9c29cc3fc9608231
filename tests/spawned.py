"""Process groups for tests that compare several processes with one: every case of one process count runs in one
group spawned once for the module (a spawned process imports torch and diffusers again: seconds on a 2-core CPU,
more than a case's own work)."""

from __future__ import annotations

from collections.abc import Callable

import torch.multiprocessing as mp


def group_runner(tmp_path_factory, worker: Callable, cases_for: Callable[[int], list]) -> Callable[[int], dict]:
    """``run(world)``: spawns ``worker(rank, world, init_file, cases, out)`` on ``world`` processes once, with
    ``cases_for(world)``, and returns the shared dict ``out`` the workers filled; a group that failed raises its
    error for each of its tests without being spawned again."""
    done: dict[int, dict | BaseException] = {}

    def run(world: int) -> dict:
        if world not in done:
            out = mp.Manager().dict()
            init = tmp_path_factory.mktemp(f"group{world}") / "init"
            try:
                mp.spawn(worker, args=(world, str(init), cases_for(world), out), nprocs=world, join=True)
                done[world] = dict(out)
            except Exception as e:  # kept: the group's other tests fail with it too, not spawned again
                done[world] = e
        result = done[world]
        if isinstance(result, BaseException):
            raise result
        return result

    return run
