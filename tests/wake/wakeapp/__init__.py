"""A stand-alone application used by the wake-up tests: copied into a temporary folder and run
with ``apsup run --app wakeapp.families`` from there, as a user's own package would be."""
