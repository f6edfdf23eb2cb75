"""The user tools outside the stages, each behind a `llmpipe` subcommand: plan (memory and throughput
of a layout), plan_deploy (what a deployment device fits), tune (measured bucket sweeps; tune_write
edits the config), generate (text from a finished run), report (the run's HTML page), dryrun (the
layout built on a fake process group). They sit above every stage and are imported by cli.py only."""
