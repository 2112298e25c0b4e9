#!/usr/bin/env python3
"""web: the offline web from inside a k3 sandbox (installed as /usr/local/bin/web).

    web search QUERY...         the best pages for QUERY
    web open URL [OFFSET]       a page's text and links
    web find URL TEXT...        the lines of a page that contain TEXT
    add --json before the command for the raw answer

Requests go to the Unix socket K3_WEB_SOCKET (default /run/k3/web.sock), which the sandbox's PID 1
relays to the host; there is no network. Standard library only: this file runs in the sandbox.
"""

import json
import os
import socket
import struct
import sys

SOCKET = os.environ.get("K3_WEB_SOCKET", "/run/k3/web.sock")


def call(request):
    body = json.dumps(request).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(30)
        connection.connect(SOCKET)
        connection.sendall(struct.pack("<I", len(body)) + body)
        data = b""
        while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
            chunk = connection.recv(1 << 16)
            if not chunk:
                raise ConnectionError("the web relay closed the connection without an answer")
            data += chunk
    return json.loads(data[4:4 + struct.unpack("<I", data[:4])[0]])


def main(argv):
    raw = bool(argv) and argv[0] == "--json"
    argv = argv[1:] if raw else argv
    if not argv or argv[0] not in ("search", "open", "find"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    tool, rest = argv[0], argv[1:]
    if tool == "search" and rest:
        request = {"tool": "search", "query": " ".join(rest)}
    elif tool == "open" and rest:
        request = {"tool": "open", "url": rest[0], "offset": int(rest[1]) if len(rest) > 1 else 0}
    elif tool == "find" and len(rest) >= 2:
        request = {"tool": "find", "url": rest[0], "text": " ".join(rest[1:])}
    else:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    answer = call(request)
    if raw:
        print(json.dumps(answer, indent=1))
        return 0 if answer.get("ok") else 1
    if not answer.get("ok"):
        print("error: " + answer.get("error", "?"), file=sys.stderr)
        return 1
    if tool == "search":
        for i, result in enumerate(answer["results"], 1):
            print(f"[{i}] {result['title']} <{result['url']}>\n    {result['snippet']}")
    elif tool == "open":
        page = answer["page"]
        print(f"{page['title']} <{page['url']}>\n\n{page['text']}\n\nLinks:")
        for i, link in enumerate(page["links"], 1):
            print(f"[{i}] {link}")
    else:
        for hit in answer["hits"]:
            print(f"line {hit['line']}: {hit['text']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
