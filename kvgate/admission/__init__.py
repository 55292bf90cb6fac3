"""Quotas and fair admission (issue 11, part 3): per-tenant rate and concurrency limits shared by every
gateway replica, the engines' running slots shared fairly between tenants, and the tenants' budgets for
background work (docs/admission.md).

Pure cores decide: ``bucket`` and ``quota`` (a tenant's limits), ``slots`` (the fair share and the queue),
``capacity`` (engine caps learned from their counters). ``store`` / ``redis_store`` keep the shared
quota state; ``gate`` runs them for a request on the event loop; ``budgets`` reads what the session
controller's background work may still spend."""
