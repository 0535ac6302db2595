"""The generation pipeline, the same for every API and for the library:

    GenerationRequest (butter/chat/request.py, built by butter/protocol)
      -> prepare: chat template, tokens, context fit          (prepare.py)
      -> run: admission and the engine, always released       (run.py)
      -> output: pieces -> text, reasoning and tool-call events (output.py)
      -> answer: each choice's events, then its finish reason, usage, timings and
         prompt progress: all an encoder reads                (answer.py)

The resident model (backend + engine + template) is in resident.py; butter.Model (the
library's, butter/model.py) runs its engine as a trio task, and the server holds one too.
"""
