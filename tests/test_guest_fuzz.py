"""Random guests (tests/guest_fuzz.py) cannot crash or hang the host, and every failure they cause is a
GuestError subclass; in a fresh interpreter, so a crash fails this test instead of the run."""

import json

from isolated import run_isolated


def test_ten_thousand_random_host_calls_fail_only_as_guest_errors():
    out = run_isolated("""
        import json
        import guest_fuzz
        print(json.dumps(guest_fuzz.run(min_calls=10_000, seed=0, max_guests=2_000)))
    """, timeout=900)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["unexpected"] == [], "\n".join(report["unexpected"])
    assert report["host_calls"] >= 10_000, report
    assert report["healthy_after"], report
    assert sum(n for k, n in report["outcomes"].items() if k != "ok") > 0  # the fuzz did find the edges
