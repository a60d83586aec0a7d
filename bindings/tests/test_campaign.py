"""The Python-API fault campaign (campaign.py) in the tests: README-style trainers through store
outages, kills, corrupt bytes, double saves, second writers, a full disk and sidecar restarts.
`HOTSTART_CAMPAIGN_FAULTS` sets the number of faults (default 300, about 40 s here) and
`HOTSTART_CAMPAIGN_SEED` the seed (default 1)."""

from __future__ import annotations

import os

import campaign
from conftest import _free_ports, _hotstart_bin, need


def test_a_campaign_of_faults_through_the_python_api_breaks_no_invariant() -> None:
    if os.geteuid() != 0:
        need("root", "the campaign mounts a small tmpfs as the disk tier, to fill it")
    faults = int(os.environ.get("HOTSTART_CAMPAIGN_FAULTS", "300"))
    seed = int(os.environ.get("HOTSTART_CAMPAIGN_SEED", "1"))
    try:
        report = campaign.run(faults, seed, _hotstart_bin(), _free_ports(2))
    except campaign.CampaignError as e:
        raise AssertionError(f"campaign with HOTSTART_CAMPAIGN_SEED={seed}: {e}") from e
    print(report.line())
    # Every kind drawn, with its effect: restarts checked, bytes flipped and detected.
    assert report.restarts > 0 and report.flipped > 0 and len(report.faults) >= 8, report.line()
