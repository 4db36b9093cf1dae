"""What owns a run: its setup, the one driver loop, the typed report, the kinds of run and the
campaigns of ``kv-canary demo``.

| file               | what                                                                    |
|--------------------|-------------------------------------------------------------------------|
| ``setup.py``       | frozen options (the CLI's defaults) and the configs they build          |
| ``driver.py``      | the driver loop: a workload through an engine or a prefill/decode pair  |
| ``report.py``      | the typed run report, merged across pools, sides, ranks, attachments    |
| ``run.py``         | ``kv-canary run``: options -> the kind of run -> its report             |
| ``single.py``      | one reference engine (with faults, if any)                              |
| ``pd.py``          | a prefill/decode split                                                  |
| ``tp.py``          | tensor-parallel ranks, one process each                                 |
| ``transformers.py``| Hugging Face transformers continuous batching                           |
| ``soak.py``        | ``kv-canary soak``                                                      |
| ``campaign.py``    | ``kv-canary demo``'s campaigns, each run judged by ``faults.judge``     |
"""
