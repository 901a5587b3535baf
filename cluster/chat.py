"""`vllm-cluster chat`: a conversation with a running cluster, one message per line.

Each turn sends the whole history (the system prompt, earlier turns, the new message) and
streams the reply as it arrives. A turn that fails or is cancelled (Ctrl-C during the
reply: the request is aborted on every instance) leaves the history as it was. `/clear`
forgets the history, `/exit` or end of input quits. Standard output carries the replies
(and, in a terminal, the `you> ` prompt); usage lines and errors go to standard error, so
stdin and stdout can be files or pipes.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TextIO

import grpc

from vllm_cluster.client import Client, ClientError, Completion


@dataclass(slots=True)
class ChatSession:
    client: Client
    system: str = ""
    max_tokens: int = 256
    temperature: float = 0.7
    history: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self.history = [{"role": "system", "content": self.system}] if self.system else []

    def turn(self, message: str, out: TextIO) -> Completion:
        """Ask; write the reply to `out` as it streams; keep both in the history. Raises
        ClientError, or KeyboardInterrupt after cancelling the request; the history then
        stays as it was."""
        messages = [*self.history, {"role": "user", "content": message}]
        stream = self.client.stream(chat=messages, max_tokens=self.max_tokens, temperature=self.temperature)
        result = Completion(stream.request_id)
        try:
            for piece in stream:
                out.write(piece.text)
                out.flush()
                result.add(piece)
        except KeyboardInterrupt:
            stream.cancel()
            raise
        finally:
            out.write("\n")
            out.flush()
        self.history = [*messages, {"role": "assistant", "content": result.text}]
        return result


def run_chat(
    session: ChatSession, stdin: TextIO = sys.stdin, out: TextIO = sys.stdout, err: TextIO = sys.stderr
) -> int:
    """The loop: 0 when every turn was answered, 1 otherwise."""
    try:
        models = session.client.list_models()
    except ClientError as e:
        print(f"error: {e}", file=err)
        return 1
    interactive = stdin is sys.stdin and stdin.isatty()
    if interactive:
        import readline  # noqa: F401  (input() gets line editing and history)
    names = ", ".join(f"{m.id} (max_model_len {m.max_model_len})" for m in models)
    print(f"connected to {session.client.address}: {names}. /clear forgets the chat, /exit quits.", file=err)
    num_failed = 0
    while (message := _read_message(stdin, interactive, err)) is not None:
        if message == "/exit":
            break
        if message == "/clear":
            session.clear()
            print("[history cleared]", file=err)
            continue
        try:
            result = session.turn(message, out)
        except KeyboardInterrupt:
            print("[cancelled]", file=err)
            continue
        except ClientError as e:
            num_failed += 1
            hint = (
                " (/clear starts a new chat)"
                if e.code == grpc.StatusCode.INVALID_ARGUMENT and len(session.history) > 1
                else ""
            )
            print(f"error: {e}{hint}", file=err)
            continue
        print(usage_line(result), file=err)
    return 1 if num_failed else 0


def usage_line(result: Completion) -> str:
    if result.usage is None or result.timings is None:
        return f"[finish_reason={result.finish_reason or 'none'}]"
    u, t = result.usage, result.timings
    return (f"[{u.completion_tokens} tokens, finish_reason={result.finish_reason}; prompt {u.prompt_tokens} tokens "
            f"({u.cached_tokens} cached); first token after {t.ttft_s * 1e3:.0f} ms, total {t.total_s * 1e3:.0f} ms]")


def _read_message(stdin: TextIO, interactive: bool, err: TextIO) -> str | None:
    """The next non-empty line, or None at end of input."""
    while True:
        try:
            line = input("you> ") if interactive else stdin.readline()
        except EOFError:
            return None
        except KeyboardInterrupt:
            print("\n(/exit or Ctrl-D quits)", file=err)
            continue
        if not interactive and not line:
            return None
        if line.strip():
            return line.strip()
