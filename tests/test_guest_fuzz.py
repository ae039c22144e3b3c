"""Random guests (tests/guest_fuzz.py) cannot crash or hang the host, and every failure they cause is a
GuestError subclass; in a fresh interpreter, so a crash fails this test instead of the run."""

import json

from isolated import run_isolated


def test_ten_thousand_random_host_calls_from_v1_and_v2_guests_fail_only_as_guest_errors():
    out = run_isolated("""
        import json
        import guest_fuzz
        print(json.dumps(guest_fuzz.run(min_calls=10_000, seed=0, max_guests=2_000)))
    """, timeout=900)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["unexpected"] == [], "\n".join(report["unexpected"])
    assert report["host_calls"] >= 10_000, report
    assert report["healthy_after"] and report["bystander_intact"], report
    outcomes = report["outcomes"]
    for version in ("v1", "v2"):  # both ABIs' guests got through messages, and failed at the edges
        assert outcomes.get(f"{version}:ok", 0) > 0, report
        assert sum(n for k, n in outcomes.items() if k.startswith(f"{version}:") and k != f"{version}:ok") > 0


def test_modules_with_mutated_section_headers_are_refused_or_compile_never_crash_the_host():
    out = run_isolated("""
        import json
        import guest_fuzz
        print(json.dumps(guest_fuzz.run_mutants(mutants=2000, seed=0)))
    """, timeout=300)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["unexpected"] == [], "\n".join(report["unexpected"][:3])
    outcomes = report["outcomes"]
    for outcome in ("refused: malformed", "refused: a bound", "refused by Wasmtime", "compiled"):
        assert outcomes.get(outcome, 0) > 0, report  # every path was taken
