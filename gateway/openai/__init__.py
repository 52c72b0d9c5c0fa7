"""The OpenAI-compatible HTTP front of the gateway (FastAPI on uvicorn, on the gRPC server's
event loop). It only translates: a JSON body becomes the fields of a gRPC GenerateRequest
(:mod:`.translate`), the gateway's one request path (gateway.pipeline.GatewayRequest, the
same one gRPC's Generate drives) serves it, and its GenerateResponse stream becomes OpenAI
JSON or server-sent events (:mod:`.render`). Routing, retries, migration, admission, usage,
metrics and tracing are the pipeline's, written once.

    errors.py     ApiError and the OpenAI error body; gRPC status -> HTTP status
    translate.py  request bodies (chat, completions) -> ClientRequest + what to render
    render.py     GenerateResponse stream -> chat.completion(.chunk) / text_completion
    tools.py      tools / tool_choice: the template's format, tool_calls parsed from answers
    drive.py      one pipeline request on its own task; the client leaving cancels it
    app.py        the routes, API keys, the body limit, the handlers
    server.py     uvicorn on the running loop, without its signal handlers
"""
