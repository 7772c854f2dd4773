"""Talk to kvgate with the official `openai` client, tagging every request's priority once with
`default_headers` (the gateway reads `x-kvgate-priority`: high | normal | low, or an integer).

    python examples/openai_client.py --base-url http://127.0.0.1:8080/v1 --model llama --priority high

Sends one plain and one streamed chat completion through the gateway and prints, for each, the worker
kvgate chose (response header x-kvgate-worker), the time it queued (x-kvgate-queued-ms) and the reply.
tests/e2e/test_examples.py runs it against emulated workers behind examples/staging.sh.
"""

from __future__ import annotations

import argparse
import os
import sys

from openai import OpenAI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8080/v1", help="the gateway's /v1 URL")
    parser.add_argument("--model", default="llama")
    parser.add_argument("--priority", default="high", help="x-kvgate-priority: high | normal | low")
    parser.add_argument("--prompt", default="Say hello in five words.")
    args = parser.parse_args(argv)

    client = OpenAI(
        base_url=args.base_url,
        # a tenant's key when the gateway has [auth] enabled; any string otherwise
        api_key=os.environ.get("OPENAI_API_KEY", "sk-no-auth"),
        default_headers={"x-kvgate-priority": args.priority},
        max_retries=0,
    )
    messages = [{"role": "user", "content": args.prompt}]

    raw = client.chat.completions.with_raw_response.create(model=args.model, messages=messages, max_tokens=16)
    reply = raw.parse()
    worker, queued_ms = raw.headers.get("x-kvgate-worker"), raw.headers.get("x-kvgate-queued-ms")
    print(f"plain:    worker={worker} queued_ms={queued_ms} text={reply.choices[0].message.content!r}")

    with client.chat.completions.with_streaming_response.create(
        model=args.model, messages=messages, max_tokens=16, stream=True
    ) as response:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in response.parse() if chunk.choices)
        print(f"streamed: worker={response.headers.get('x-kvgate-worker')} text={text!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
