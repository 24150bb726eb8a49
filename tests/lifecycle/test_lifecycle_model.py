"""The operator's lifecycle, model-based (tests/lifecycle/lifecycle_model.py): CI-sized
here; scripts/lifecycle_campaign.py runs it longer for reports/RELIABILITY.md."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, settings
from lifecycle_model import Lifecycle

pytestmark = pytest.mark.slow  # a few hundred commands: CI runs it, `-m 'not slow'` leaves it out

TestLifecycle = Lifecycle.TestCase
TestLifecycle.settings = settings(max_examples=30, stateful_step_count=30, deadline=None, derandomize=True,
                                  suppress_health_check=list(HealthCheck), database=None,
                                  phases=(Phase.explicit, Phase.generate))  # (no shrinking in CI: minutes)
