"""Quotas and fair admission (issue 11, part 3): per-tenant rate and concurrency limits shared by every
gateway replica, and a weighted-fair queue for the fleet's slots (docs/admission.md).

Pure cores (``bucket``, ``fairqueue``, ``quota``) decide; ``memory_store`` / ``redis_store`` keep the
shared state; ``gate`` runs them for a request on the event loop."""
