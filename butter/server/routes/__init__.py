"""The HTTP routes: one module per API, plus the probes and the chat page. `register`
adds them all to an app, in one place."""

from __future__ import annotations

from quart_trio import QuartTrio

from butter.server.routes import anthropic, ollama, openai, pages, probes, tokenizer

API_PREFIX = "/v1"


def register(app: QuartTrio) -> None:
    app.register_blueprint(probes.routes)
    app.register_blueprint(pages.routes)
    for api in (openai.routes, anthropic.routes, tokenizer.routes):
        # Under /v1 and without it: clients configured with the bare server URL call
        # /chat/completions (llama-server answers both spellings too).
        app.register_blueprint(api, url_prefix=API_PREFIX)
        app.register_blueprint(api, name=f"{api.name}_bare")
    app.register_blueprint(ollama.routes, url_prefix=ollama.PREFIX)
