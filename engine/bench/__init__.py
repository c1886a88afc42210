"""`python -m engine.bench ...`: the command line over engine/measure (the library the playground calls too), and
the tools only a command line needs:

    cli.py          the subcommands: the only module that prints
    serve.py        `serve`: an HTTP load generator for any OpenAI-compatible server (httpx; no engine)
    versus.py       `versus`: this engine's server against another (vLLM), alternated cell by cell
    overhead.py     `serve-overhead`: python app.py + serve vs LLM.generate in fresh processes, side by side
    kernel_worth.py `kernel-worth`: each C++ CPU kernel against its torch path, end to end
    gpu_check.py    `gpu-check`: the GPU path checked on a lent GPU

Nothing imports this package but its own command line and its tests.
"""
