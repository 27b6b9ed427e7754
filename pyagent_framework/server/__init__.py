"""The OpenAI-compatible HTTP server (``pyagent serve``): FastAPI over :class:`AsyncLLM`.

:func:`build_app` makes the ASGI app over a running engine; :func:`serve` builds
the engine from configs and runs uvicorn until SIGINT/SIGTERM, which drains running
requests (up to ``shutdown_timeout`` seconds) before exiting.
"""

from __future__ import annotations

from pyagent_framework.server.config import ServerConfig, make_engine_config, make_server_config

__all__ = ["ServerConfig", "build_app", "load_parsers", "make_engine_config", "make_server_config", "serve"]


def load_parsers(config: ServerConfig) -> tuple[type | None, type | None]:
    """The tool-call and reasoning parser classes the config names (checked by name,
    an unknown one failing with the list of registered ones)."""
    from pyagent_framework import registries
    from pyagent_framework.engine.errors import ConfigError
    from pyagent_framework.engine.loader import load_entry

    if config.enable_auto_tool_choice and not config.tool_call_parser:
        raise ConfigError("enable_auto_tool_choice needs tool_call_parser to name a parser", field="tool_call_parser")
    tool = load_entry(registries.tool_parsers, config.tool_call_parser, "tool_call_parser") if config.tool_call_parser else None
    reasoning = (
        load_entry(registries.reasoning_parsers, config.reasoning_parser, "reasoning_parser") if config.reasoning_parser else None
    )
    return tool, reasoning


def build_app(engine, config: ServerConfig, **options):
    from pyagent_framework.server.app import build_app as _build

    return _build(engine, config, **options)


# After the engine dies, how long open responses get to carry its error out before the
# process exits (non-zero) anyway.
DEAD_EXIT_SECONDS = 2.0
EXIT_ENGINE_DEAD = 3


def serve(engine_config, config: ServerConfig) -> None:
    """Load the model, then serve until SIGINT/SIGTERM. If the engine dies (its model
    forward failed, or the watchdog found a step stuck for ``step_timeout`` seconds),
    the process exits with status 3 within a few seconds, for a supervisor to restart it."""
    import logging
    import os
    import signal
    import threading

    import uvicorn

    from pyagent_framework.engine.async_llm import AsyncLLM

    load_parsers(config)  # before the weights load: fail fast
    log = logging.getLogger("pyagent_framework")
    server: uvicorn.Server | None = None

    def exit_now() -> None:
        log.critical("exiting: the engine is dead")
        logging.shutdown()
        os._exit(EXIT_ENGINE_DEAD)  # no clean-up can be trusted to finish (the engine thread may hang)

    def engine_died(error: BaseException) -> None:
        if server is not None:
            server.should_exit = True  # stop accepting; open requests have their error already
        threading.Timer(DEAD_EXIT_SECONDS, exit_now).start()

    engine = AsyncLLM.from_config(engine_config, step_timeout=config.step_timeout, on_dead=engine_died)
    model_name = config.served_model_name or engine_config.model or "smollm2"
    app = build_app(engine, config, model_name=model_name)
    logging.getLogger("pyagent_framework").info("serving %r on http://%s:%d", model_name, config.host, config.port)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            timeout_graceful_shutdown=config.shutdown_timeout,
            lifespan="on",
        )
    )
    # uvicorn drains on SIGTERM, then re-raises the signal to the handler it found:
    # a no-op one here, so a drained server exits with status 0.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
        if engine.error is not None:
            exit_now()
        engine.shutdown()
        tracing = app.state.serving.metrics.tracing
        if tracing is not None:
            tracing.shutdown()  # the spans still batched go out
