"""The engine: requests, the scheduler, the KV block manager, the coordinator's overlapped
loop and the executor that drives the worker actors. Above the per-rank step (`workers/`)."""
