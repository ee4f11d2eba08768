"""Scratch gate: the router's CPU a request at concurrency 16 (non-streaming), one process serving the same router app
three ways on three ports, rows alternating: uvicorn with the ASGI layer (as `pdserve router` served before
router/hot_routes.py's protocol), uvicorn with that protocol (hot POSTs without the ASGI messages; run 3 ran an inline
copy of it, which became hot_routes.py), and a bare httptools protocol handing a hot POST to its handler (a measure,
not a server). Run from the repository root: `ROUNDS=5 python docs/bench-cpu/router-bare-front-2026-11-28/front_gate.py
run`."""
import argparse, asyncio, gc, os, secrets, subprocess, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
os.environ.setdefault("PDSERVE_INTERNAL_TOKEN", secrets.token_urlsafe(32))
from pdserve.http.internal_auth import TOKEN_ENV
os.environ[TOKEN_ENV] = os.environ["PDSERVE_INTERNAL_TOKEN"]
import router_overhead as ro
from pdserve.http.ports import free_port

def serve(model_dir, stand_in_url, p_uv, p_raw, p_hyb):
    import httptools, uvicorn, uvloop
    from starlette.requests import Request
    from pdserve.http.slow_clients import KEEP_ALIVE_S, SlowClientLimits, bounded_http
    from pdserve_router.app import build_router_app
    from pdserve_router.config import add_router_arguments, router_config_from_args
    parser = argparse.ArgumentParser(); add_router_arguments(parser)
    args = parser.parse_args(["--model", model_dir, "--served-model-name", ro.MODEL, "--workers", stand_in_url,
                              "--host", "127.0.0.1", "--port", str(p_uv)])
    config = router_config_from_args(args)
    app = build_router_app(config)

    class Raw(asyncio.Protocol):
        def connection_made(self, t):
            self.t = t; self.parser = httptools.HttpRequestParser(self); self.headers = []; self.body = []
        def data_received(self, data): self.parser.feed_data(data)
        def on_url(self, url): self.url = url
        def on_header(self, n, v): self.headers.append((n.lower(), v))
        def on_body(self, b): self.body.append(b)
        def on_message_complete(self):
            body, headers = b"".join(self.body), self.headers
            self.body, self.headers = [], []
            asyncio.get_running_loop().create_task(self.handle(self.url.decode(), headers, body))
        async def handle(self, path, headers, body):
            async def receive():
                return {"type": "http.request", "body": body, "more_body": False}
            scope = {"type": "http", "method": "POST", "path": path, "raw_path": path.encode(), "headers": headers,
                     "query_string": b"", "app": app, "client": ("127.0.0.1", 1), "server": ("127.0.0.1", p_raw),
                     "scheme": "http", "root_path": "", "http_version": "1.1"}
            request = Request(scope, receive)
            try:
                response = await app.hot_posts[path](request)
            except Exception as error:
                response = await app._handler_for(error)(request, error)
            head = [b"HTTP/1.1 %d OK\r\n" % response.status_code]
            for n, v in response.raw_headers:
                head += [n, b": ", v, b"\r\n"]
            head.append(b"\r\n")
            self.t.write(b"".join(head) + response.body)

    from pdserve_router.hot_routes import hot_route_http

    async def main():
        hybrid = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=p_hyb, log_level="warning", http=hot_route_http(SlowClientLimits(), app),
                                               timeout_keep_alive=KEEP_ALIVE_S, access_log=False, proxy_headers=False,
                                               lifespan="off"))
        asyncio.get_running_loop().create_task(hybrid.serve())
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=p_uv, log_level="warning",
                                               http=bounded_http(SlowClientLimits()), timeout_keep_alive=KEEP_ALIVE_S,
                                               access_log=False, proxy_headers=False))
        raw = await asyncio.get_running_loop().create_server(Raw, "127.0.0.1", p_raw)
        gc.freeze()
        await server.serve()
    uvloop.run(main())

if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(*sys.argv[2:4], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])); sys.exit()
    from pdserve.model.tiny import make_tiny_model
    model_dir = make_tiny_model(Path(tempfile.mkdtemp(prefix="front-exp-")) / "model")
    sp, pu, pr, ph = free_port(), free_port(), free_port(), free_port()
    stand = subprocess.Popen([sys.executable, "benchmarks/router_overhead.py", "stand-in", "--port", str(sp), "--token-interval-ms", "0"])
    ro.wait_up(f"http://127.0.0.1:{sp}", "/health")
    srv = subprocess.Popen([sys.executable, __file__, "serve", str(model_dir), f"http://127.0.0.1:{sp}", str(pu), str(pr), str(ph)])
    try:
        ro.wait_up(f"http://127.0.0.1:{pu}", "/ready")
        asyncio.run(ro.load(f"http://127.0.0.1:{pr}", 16, 200, False, 64))  # the raw front answers too
        asyncio.run(ro.load(f"http://127.0.0.1:{ph}", 16, 200, False, 64))  # and the hybrid
        print("| round | front | req/s | share of direct | p50 ms | router CPU us / request |")
        print("| --- | --- | ---: | ---: | ---: | ---: |")
        for rnd in range(int(os.environ.get("ROUNDS", "4"))):
            direct = asyncio.run(ro.load(f"http://127.0.0.1:{sp}", 16, 3000, False, 64))
            print(f"| {rnd} | direct (stand-in) | {direct['req_s']:.0f} | 1.00 | {direct['p50_ms']:.2f} | - |", flush=True)
            for name, port in (("uvicorn, ASGI layer", pu), ("uvicorn, hot_route_http", ph), ("bare httptools front", pr)):
                c0 = ro.cpu_seconds(srv.pid)
                r = asyncio.run(ro.load(f"http://127.0.0.1:{port}", 16, 3000, False, 64))
                c1 = ro.cpu_seconds(srv.pid)
                print(f"| {rnd} | {name} | {r['req_s']:.0f} | {r['req_s'] / direct['req_s']:.2f} | {r['p50_ms']:.2f} | {(c1 - c0) / 3000 * 1e6:.0f} |", flush=True)
    finally:
        srv.terminate(); stand.terminate(); srv.wait(); stand.wait()
