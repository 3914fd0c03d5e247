"""A job's life, one module per stage, in the order a job meets them:

1. `payload`: what a job carries (JSON text, never pickle) and the keys that dedupe it;
2. `push`: the only maker of job rows, whoever enqueues (push, pipelines, schedules, the
   Django Tasks backend, follow-ups), so a handler's settings apply everywhere;
   `buffer`: the jobs a full queue left in the pushing process;
3. `queues`: queues' settings and bounds, and what a full queue does to a push;
4. `claim`: a worker takes due jobs, `FOR UPDATE SKIP LOCKED`;
5. `limits`: per-key concurrency and rate, decided inside the claim;
   `leasing`: a job that needs a resource, claimed together with a lease on one;
6. `outcomes`: an attempt's end written, fenced by its claim; follow-ups of endings;
   `handoff`: a job whose handler its worker lacks, to a worker that has it;
7. `recovery`: leases on running attempts, renewed by heartbeats, recovered when they lapse;
8. `actions`: an operator's retry, cancel and discard;
9. `history`: the last runs of a key kept, the rest pruned.
"""
