"""``python -m mostovik_pipelines_tests.chaos [--seed N] [--suites LIST] [--scenarios N]
[--cli-share F] [--sync-scenarios N] [--file-scenarios N] [--platform-scenarios N]
[--platform-kinds LIST] [--calendar-days N] [--calendar-lookback-days N] [--no-calendar-truth]
[--keep]``
(``make chaos``; see docs/testing.md)

Starts its own PostgreSQL and stand-in and runs every kind of job through the one harness
(:mod:`.harness`), all from one seed:

* ``parser``: the CBR rates (:mod:`.scenarios`): crashes, source faults, duplicates, re-runs,
  ranged runs and re-executions;
* ``sync``: the ERP work orders (:mod:`.sync_scenarios`): kills mid-window, resumes, token
  expiry, late updates;
* ``file``: the delivery reports (:mod:`.file_scenarios`): re-uploads racing runs, kills,
  bad rows, replays;
* ``platform``: the faults of the parts we stand on under the production deployment
  (:mod:`.platform`): the warehouse, run storage and broker each away 60 s once, then for
  random outages, the daemon killed, the host lost, the landing disk full, a run's claim cut
  off, a wrong setting, and the run storage away past the budget (110 s);
* ``calendar``: simulated days of every scheduled source and the inbox on a fake clock, over
  the 4 November holiday, with operators' re-runs in flight during ticks, and what the operator
  is told compared with the truth after every tick (:mod:`.calendar_scenarios`);
* ``outages``: the test cases of the promised 60 s outages and of outages past a budget, which
  ``make test`` leaves out (:mod:`.outage_cases`).

It prints one line per scenario, each suite's summary, then per kind and per fault the
scenarios, differences, duplicated keys, unsettled partitions (or runs failed on a fault the
deployment rides out) and runs stuck unfinished, and exits 1 if any of these is not 0 or a
suite reported a failure. The same seed replays the same scenarios (timing aside).
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import time

from mostovik_pipelines_tests.chaos import run_chaos
from mostovik_pipelines_tests.chaos.calendar_scenarios import run_calendar_chaos
from mostovik_pipelines_tests.chaos.environment import ChaosEnvironment
from mostovik_pipelines_tests.chaos.file_scenarios import run_file_chaos
from mostovik_pipelines_tests.chaos.outage_cases import run_outage_cases
from mostovik_pipelines_tests.chaos.platform import run_platform_chaos
from mostovik_pipelines_tests.chaos.sync_scenarios import run_sync_chaos
from mostovik_pipelines_tests.chaos.tally import Tally

SUITES = ("parser", "sync", "file", "platform", "calendar", "outages")


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m mostovik_pipelines_tests.chaos")
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed")
    parser.add_argument("--suites", default=",".join(SUITES),
                        help=f"comma-separated, of {', '.join(SUITES)} (default: all)")
    parser.add_argument("--scenarios", type=int, default=200, help="parser scenarios")
    parser.add_argument("--cli-share", type=float, default=0.35,
                        help="share of parser scenarios that start and kill `dagster job "
                             "execute`, and of re-executions by `mostovik jobs rerun`")
    parser.add_argument("--sync-scenarios", type=int, default=30)
    parser.add_argument("--file-scenarios", type=int, default=30)
    parser.add_argument("--platform-scenarios", type=int, default=20,
                        help="scenarios of faults of the parts we stand on under the "
                             "production layout, the kinds in turn")
    parser.add_argument("--platform-kinds", type=lambda text: tuple(text.split(",")),
                        default=None,
                        help="only these platform kinds (comma-separated), in a seeded order")
    parser.add_argument("--calendar-days", type=int, default=7,
                        help="simulated days of the calendar suite")
    parser.add_argument("--calendar-lookback-days", type=int, default=7,
                        help="each calendar source's lookback (a shorter one: smaller first "
                             "ticks and runs while a source is down)")
    parser.add_argument("--no-calendar-truth", action="store_true",
                        help="skip comparing what the operator is told with the truth at each "
                             "calendar tick (the webserver, metrics and Prometheus it starts)")
    parser.add_argument("--keep", action="store_true", help="keep the work dirs (run logs)")
    args = parser.parse_args(argv)
    args.suites = [name.strip() for name in args.suites.split(",") if name.strip()]
    unknown = set(args.suites) - set(SUITES)
    if unknown:
        parser.error(f"unknown suites: {', '.join(sorted(unknown))}")
    return args


def replay_command(args, seed: int) -> str:
    return (f"python -m mostovik_pipelines_tests.chaos --seed {seed} "
            f"--suites {','.join(args.suites)} --scenarios {args.scenarios} "
            f"--cli-share {args.cli_share} --sync-scenarios {args.sync_scenarios} "
            f"--file-scenarios {args.file_scenarios} "
            f"--platform-scenarios {args.platform_scenarios} "
            + (f"--platform-kinds {','.join(args.platform_kinds)} " if args.platform_kinds
               else "")
            + f"--calendar-days {args.calendar_days} "
            f"--calendar-lookback-days {args.calendar_lookback_days}"
            + (" --no-calendar-truth" if args.no_calendar_truth else ""))


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"chaos: seed {seed}, suites {', '.join(args.suites)}", flush=True)
    print(f"chaos: replay with {replay_command(args, seed)}", flush=True)
    # A plain kill must still stop the servers started here (the finally block below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.monotonic()

    def log(line: str) -> None:
        print(line, flush=True)

    tally = Tally()
    failures: list[str] = []
    env = ChaosEnvironment(keep=args.keep)
    try:
        postgres, standin_server = env.postgres, env.standin_server
        for name in args.suites:
            begun = time.monotonic()
            log(f"\nchaos: {name} suite")
            if name == "parser":
                totals = run_chaos(env, seed, args.scenarios, args.cli_share, log=log,
                                   tally=tally)
            elif name == "sync":
                totals = run_sync_chaos(postgres, standin_server, seed, args.sync_scenarios,
                                        keep=args.keep, log=log, tally=tally)
            elif name == "file":
                totals = run_file_chaos(postgres, seed, args.file_scenarios, keep=args.keep,
                                        log=log, tally=tally)
            elif name == "platform":
                totals = run_platform_chaos(postgres, standin_server, seed,
                                            args.platform_scenarios, log=log, tally=tally,
                                            kinds=args.platform_kinds)
            elif name == "outages":
                totals = run_outage_cases(log=log)
            else:
                totals = run_calendar_chaos(postgres, standin_server, seed, args.calendar_days,
                                            lookback_days=args.calendar_lookback_days,
                                            log=log, tally=tally,
                                            truth=not args.no_calendar_truth)
            failures += [f"{name}: {failure}" for failure in totals.failures]
            log(f"chaos: {name} suite done in {time.monotonic() - begun:.0f} s; the table so "
                f"far:{tally.table()}")
    finally:
        if args.keep:
            print(f"work dir kept: {env.root}")
        env.close()
        log(tally.table())  # also when stopped: what the suites that ran found
    log(f"\n  suites' failures:     {len(failures)}")
    log(f"  wall time:            {time.monotonic() - started:.0f} s")
    log(f"  seed:                 {seed}   (replay: {replay_command(args, seed)})")
    return 1 if failures or tally.failed() else 0


if __name__ == "__main__":
    sys.exit(main())
