"""`make bench`: the fence's cost and the queue's ceiling, side by side in one run."""

from __future__ import annotations

import json
import logging
import platform
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import connection

from devtools.bench.runner import (
    WORKER_CLASSES,
    Bench,
    db_round_trips,
    fenced,
    inbox_cost,
    noop,
    purge_rate,
    reconciler_rate,
    session_reuse,
    unfenced,
)


class Command(BaseCommand):
    help = (
        "Benchmark, in one run: fenced vs unfenced checkout throughput, RQ no-op ceiling per "
        "worker class, database round trips per checkout, scaling over 1/2/4 workers, the same "
        "over TLS with the per-charge saving of session reuse, inbox cost, reconciler rate, "
        "inbox purge rate. Needs a database of its own (its name must end in _bench): it "
        "empties it."
    )

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--orders", type=int, default=200, help="Checkouts per batch.")
        parser.add_argument("--noops", type=int, default=1000, help="No-op jobs per batch.")
        parser.add_argument(
            "--latency",
            type=float,
            default=0.02,
            help="Seconds the fake provider takes per charge.",
        )
        parser.add_argument(
            "--realistic-latency",
            type=float,
            default=0.2,
            help="A Stripe-like charge latency for a second comparison.",
        )
        parser.add_argument(
            "--count-orders", type=int, default=50, help="Checkouts whose round trips are counted."
        )
        parser.add_argument(
            "--session-charges",
            type=int,
            default=200,
            help="Sequential charges per side for the session reuse comparison.",
        )
        parser.add_argument("--inbox-jobs", type=int, default=1000)
        parser.add_argument("--reconcile", type=int, default=100)
        parser.add_argument("--purge-rows", type=int, default=1_000_000)
        parser.add_argument("--purge-batch", type=int, default=1000)
        parser.add_argument("--output", default=None, help="JSON file for the results.")

    def handle(self, *args: object, **options: object) -> None:
        name = connection.settings_dict["NAME"]
        if not name.endswith("_bench"):
            raise CommandError(
                f"the bench empties its database; {name!r} does not end in "
                "_bench (make bench sets DATABASE_URL for you)"
            )
        out = Path(options["output"] or Path(settings.BASE_DIR) / "var" / "bench" / "results.json")
        n, say = options["orders"], self.stdout.write
        # The reconciler runs in this process: its step records would bury the table.
        for name in ("payments", "inbox"):
            logging.getLogger(name).setLevel(logging.WARNING)
        figures: dict[str, object] = {
            "machine": f"{platform.machine()}, {platform.system()} {platform.release()}, "
            f"{_cpus()} cores, Python {platform.python_version()}",
            "provider_latency_seconds": options["latency"],
        }
        log_dir = Path(settings.BASE_DIR) / "var" / "log" / "bench"
        with Bench(latency=options["latency"], log_dir=log_dir, say=say) as bench:
            per_class = {}
            for cls in WORKER_CLASSES:
                say(f"{cls}: no-op ceiling, fenced and unfenced checkout (2 workers)...")
                noop_s = bench.batch(noop(options["noops"]), workers=2, worker_class=cls)
                rounds = []
                for _ in range(2):  # alternate, take each side's best
                    f = bench.batch(fenced(n), workers=2, worker_class=cls)
                    u = bench.batch(unfenced(n), workers=2, worker_class=cls)
                    rounds.append((f, u))
                fenced_s = min(f for f, _ in rounds)
                unfenced_s = min(u for _, u in rounds)
                per_class[cls] = {
                    "noop_jobs_per_second": options["noops"] / noop_s,
                    "fenced_checkouts_per_second": n / fenced_s,
                    "unfenced_checkouts_per_second": n / unfenced_s,
                    "fenced_jobs_per_second": 3 * n / fenced_s,
                }
                per_class[cls]["fenced_to_unfenced"] = unfenced_s / fenced_s
                per_class[cls]["fenced_jobs_to_noop_jobs"] = (
                    per_class[cls]["fenced_jobs_per_second"]
                    / per_class[cls]["noop_jobs_per_second"]
                )
            figures["worker_classes"] = per_class
            best = max(per_class, key=lambda c: per_class[c]["fenced_checkouts_per_second"])
            slow = options["realistic_latency"]
            say(f"fenced vs unfenced with {best}, 4 workers, at {slow * 1000:.0f} ms per charge...")
            bench.set_latency(slow)
            f = bench.batch(fenced(n // 2), workers=4, worker_class=best)
            u = bench.batch(unfenced(n // 2), workers=4, worker_class=best)
            bench.set_latency(options["latency"])
            figures["realistic_latency"] = {
                "latency_seconds": slow,
                "workers": 4,
                "fenced_checkouts_per_second": (n // 2) / f,
                "unfenced_checkouts_per_second": (n // 2) / u,
                "fenced_to_unfenced": u / f,
            }
            figures["faster_worker_class"] = best
            say("database round trips per checkout, fenced and unfenced (2 workers)...")
            figures["db_round_trips"] = db_round_trips(bench, options["count_orders"], workers=2)
            say("provider session reuse over plain HTTP...")
            bench.set_latency(0)
            figures["session_reuse_http"] = session_reuse(bench, options["session_charges"])
            bench.set_latency(options["latency"])
            say(f"scaling with {best} over 1, 2, 4 workers...")
            figures["scaling"] = {
                k: n / bench.batch(fenced(n), workers=k, worker_class=best) for k in (1, 2, 4)
            }
            say("inbox-protected vs unprotected local handler...")
            bench.reset()
            cost = inbox_cost(bench, options["inbox_jobs"], rounds=5)
            figures["inbox_ms_per_job"] = cost
            figures["inbox_cost_ratio"] = cost["protected"] / cost["unprotected"]
            say("reconciler...")
            figures["reconciler"] = reconciler_rate(bench, options["reconcile"], best)
            say(f"inbox purge of {options['purge_rows']:,} rows...")
            bench.reset()
            figures["purge"] = purge_rate(options["purge_rows"], options["purge_batch"])
            bench.reset()
        with Bench(latency=options["latency"], log_dir=log_dir, say=say, tls=True) as bench:
            say(f"over TLS: fenced vs unfenced with {best}, 2 workers, session reuse...")
            rounds = []
            for _ in range(2):
                f = bench.batch(fenced(n), workers=2, worker_class=best)
                u = bench.batch(unfenced(n), workers=2, worker_class=best)
                rounds.append((f, u))
            fenced_s, unfenced_s = min(f for f, _ in rounds), min(u for _, u in rounds)
            bench.set_latency(0)
            figures["tls"] = {
                "fenced_checkouts_per_second": n / fenced_s,
                "unfenced_checkouts_per_second": n / unfenced_s,
                "fenced_to_unfenced": unfenced_s / fenced_s,
                "session_reuse": session_reuse(bench, options["session_charges"]),
            }
            bench.reset()
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=2, sort_keys=True))
        for line in _table(figures):
            say(line)
        say(f"\nSaved to {out}")


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def _table(f: dict) -> list[str]:
    rows = [
        ("machine", f["machine"]),
        ("provider latency per charge", f"{f['provider_latency_seconds'] * 1000:.0f} ms"),
    ]
    for cls, v in f["worker_classes"].items():
        rows += [
            (f"{cls}: no-op jobs/s (context)", f"{v['noop_jobs_per_second']:.0f}"),
            (f"{cls}: fenced checkouts/s", f"{v['fenced_checkouts_per_second']:.1f}"),
            (f"{cls}: unfenced checkouts/s", f"{v['unfenced_checkouts_per_second']:.1f}"),
            (
                f"{cls}: fenced / unfenced, 2 workers (goal >= 0.95)",
                f"{v['fenced_to_unfenced']:.2f}",
            ),
            (
                f"{cls}: fenced jobs/s / no-op jobs/s (context)",
                f"{v['fenced_jobs_to_noop_jobs']:.2f}",
            ),
        ]
    rows.append(("faster worker class", f["faster_worker_class"]))
    r = f["realistic_latency"]
    rows.append(
        (
            f"at {r['latency_seconds'] * 1000:.0f} ms per charge, {r['workers']} workers: "
            "fenced / unfenced (goal >= 0.97)",
            f"{r['fenced_to_unfenced']:.2f} ({r['fenced_checkouts_per_second']:.1f} vs "
            f"{r['unfenced_checkouts_per_second']:.1f} checkouts/s)",
        )
    )
    d = f["db_round_trips"]
    for side, goal in (("fenced", " (goal <= 15, <= 7 commits)"), ("unfenced", "")):
        w = d[side]["worker_per_checkout"]
        rows.append(
            (
                f"DB round trips per {side} checkout, worker side{goal}",
                f"{w['total']:.1f} = {w['statements']:.1f} statements ({w['savepoints']:.1f} "
                f"savepoint) + {w['begins']:.1f} BEGIN + {w['commits']:.1f} COMMIT + "
                f"{w['rollbacks']:.1f} ROLLBACK + {w['health_checks']:.1f} health checks",
            )
        )
    a = d["fenced"]["api_per_checkout"]
    rows.append(
        (
            "DB round trips per fenced checkout, API side (goal <= 6)",
            f"{a['total']:.1f} = {a['statements']:.1f} statements ({a['savepoints']:.1f} "
            f"savepoint) + {a['begins']:.1f} BEGIN + {a['commits']:.1f} COMMIT + "
            f"{a['health_checks']:.1f} health checks (unfenced: 0, it only enqueues)",
        )
    )
    t = f["tls"]
    rows.append(
        (
            "over TLS, 2 workers: fenced / unfenced",
            f"{t['fenced_to_unfenced']:.2f} ({t['fenced_checkouts_per_second']:.1f} vs "
            f"{t['unfenced_checkouts_per_second']:.1f} checkouts/s)",
        )
    )
    for label, s in (("HTTP", f["session_reuse_http"]), ("TLS", t["session_reuse"])):
        rows.append(
            (
                f"{label}: ms per charge, session reused / new session per charge",
                f"{s['reuse_ms']:.2f} / {s['new_session_ms']:.2f} "
                f"(saving {s['saving_ms']:.2f} ms per charge)",
            )
        )
    s = f["scaling"]
    rows.append(
        ("fenced checkouts/s with 1 / 2 / 4 workers", f"{s[1]:.1f} / {s[2]:.1f} / {s[4]:.1f}")
    )
    c = f["inbox_ms_per_job"]
    rows.append(
        (
            "inbox: ms per job unprotected / protected",
            f"{c['unprotected']:.2f} / {c['protected']:.2f}",
        )
    )
    rows.append(("inbox cost ratio (goal <= 1.15)", f"{f['inbox_cost_ratio']:.2f}"))
    r = f["reconciler"]
    rows.append(
        (
            "reconciler: uncertain claims settled/s",
            f"{r['per_second']:.1f} ({r['settled']} of {r['uncertain']})",
        )
    )
    p = f["purge"]
    rows += [
        (
            "purge: batched rows/s",
            f"{p['batched_rows_per_second']:,.0f} ({p['batches']} batches of {p['batch_size']})",
        ),
        ("purge: longest batch", f"{p['longest_batch_seconds'] * 1000:.1f} ms"),
        ("purge: one unbounded DELETE rows/s", f"{p['unbounded_rows_per_second']:,.0f}"),
        ("purge: batched / unbounded rate", f"{p['ratio_batched_to_unbounded_rate']:.2f}"),
    ]
    width = max(len(a) for a, _ in rows)
    return [""] + [f"  {a:<{width}}  {b}" for a, b in rows]
