"""What-if replay for tuning (``kvgate tune``): a gateway's request log replayed through kvgate's router
and session controller on simulated engines in virtual time, with candidate settings."""
