"""``python -m mostovik_pipelines_tests.chaos [--seed N] [--scenarios N] [--cli-share F]
[--platform-scenarios N] [--calendar-days N]``

Starts its own PostgreSQL and stand-in, runs the scenarios, then the faults of the parts we stand
on under the production deployment (:mod:`.platform`), then the calendar (:mod:`.calendar_
scenarios`: simulated days of every scheduled source on a fake clock, with source outages,
a permanent failure and the daemon down), prints one line per scenario and a summary of each,
and exits 1 if any partition differed from its expected state, any key was duplicated, a
partition could not be settled, a dead run left a partition blocked, a run failed on a fault the
deployment rides out, or the calendar left a period without its data. The same seed replays the
same scenarios (timing aside).
"""

from __future__ import annotations

import argparse
import random
import sys

from mostovik_pipelines_tests.chaos import run_chaos
from mostovik_pipelines_tests.chaos.calendar_scenarios import run_calendar_chaos
from mostovik_pipelines_tests.chaos.environment import ChaosEnvironment
from mostovik_pipelines_tests.chaos.platform import run_platform_chaos


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mostovik_pipelines_tests.chaos")
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed")
    parser.add_argument("--scenarios", type=int, default=200)
    parser.add_argument("--cli-share", type=float, default=0.35,
                        help="share of scenarios that start and kill `dagster job execute`, "
                             "and of re-executions from failure by `mostovik jobs rerun`")
    parser.add_argument("--platform-scenarios", type=int, default=20,
                        help="scenarios of warehouse, run-storage, broker, daemon and full-disk "
                             "faults under the production deployment (0: none)")
    parser.add_argument("--calendar-days", type=int, default=7,
                        help="simulated days of the calendar suite (0: none)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (run logs)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"chaos: seed {seed}, {args.scenarios} scenarios", flush=True)
    env = ChaosEnvironment(keep=args.keep)
    try:
        totals = run_chaos(env, seed, args.scenarios, args.cli_share,
                           log=lambda line: print(line, flush=True))
        platform = (run_platform_chaos(env.postgres, env.standin_server, seed,
                                       args.platform_scenarios,
                                       log=lambda line: print(line, flush=True))
                    if args.platform_scenarios else None)
        calendar = (run_calendar_chaos(env.postgres, env.standin_server, seed,
                                       args.calendar_days,
                                       log=lambda line: print(line, flush=True))
                    if args.calendar_days else None)
    finally:
        if args.keep:
            print(f"work dir kept: {env.root}")
        env.close()
    failed = (totals.failures or totals.duplicates or (platform and platform.failures)
              or (calendar and calendar.failures))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
