"""Three replicas on loopback behind one client channel that balances per call
(round_robin over all three addresses, as a Kubernetes client does over a
headless Service): calls spread over the replicas; SIGTERM to one of them in
the middle of the load lets its streams finish, new calls go to the other two,
and no call fails.

    /usr/bin/python3 -m pytest -q -p no:cacheprovider tests/service/test_replicas_e2e.py
"""

import json
import signal
import threading
import time

import grpc

from e2e_support import RPC_TIMEOUT, Client, Server, wait_for


# The client configuration deploy/README.md recommends. GOAWAY stops new calls
# to a draining replica, and gRPC retries a call the replica refused
# transparently; but a call that reached the replica just as it began to
# shut down, before any response, can still be cancelled by gRPC itself
# (CANCELLED) or refused (UNAVAILABLE). No token was generated for such a
# call, so a retry policy resends it to another replica; a stream that has
# received a message is never retried.
RETRY_SERVICE_CONFIG = json.dumps({"methodConfig": [{
    "name": [{"service": "coalesce.v1.Generator"}],
    "retryPolicy": {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                    "backoffMultiplier": 2, "retryableStatusCodes": ["UNAVAILABLE", "CANCELLED"]},
}]})


def ok_count(client):
    return client.metrics().get("coalesce_requests_total", status="ok")


def test_round_robin_spreads_calls_and_a_drained_replica_fails_nothing(pb, golden):
    servers = [Server(["--grace_period=20s", "--batch_window=0"]) for _ in range(3)]
    clients = []
    channel = None
    try:
        for s in servers:
            c = Client(s)
            c.bind(pb)
            clients.append(c)
        target = "ipv4:" + ",".join(s.address for s in servers)
        channel = grpc.insecure_channel(target, options=[
            ("grpc.lb_policy_name", "round_robin"),
            ("grpc.enable_retries", 1),
            ("grpc.service_config", RETRY_SERVICE_CONFIG)])
        grpc.channel_ready_future(channel).result(timeout=30)
        generate = channel.unary_stream(
            "/coalesce.v1.Generator/Generate",
            request_serializer=pb.g.GenerateRequest.SerializeToString,
            response_deserializer=pb.g.GenerateResponse.FromString)
        case = golden[0]

        def call(max_new_tokens):
            req = pb.g.GenerateRequest(prompt=case["prompt"], max_new_tokens=max_new_tokens)
            ids = []
            try:
                for m in generate(req, timeout=RPC_TIMEOUT):
                    ids.extend(m.token_ids)
            except grpc.RpcError as e:
                raise AssertionError("%s after %d tokens: %s" % (
                    e.code(), len(ids), e.debug_error_string())) from None
            assert ids == case["output_ids"][:max_new_tokens]

        # 1. Calls spread over all three replicas. round_robin uses a replica
        # once its connection is up, and channel_ready_future returns when
        # the first one is, so the first calls may all go to one or two.
        for _ in range(60):
            call(8)
            counts = [ok_count(c) for c in clients]
            if all(n >= 2 for n in counts):
                break
        assert all(n >= 2 for n in counts), counts

        # 2. Load from six threads; SIGTERM replica 0 in the middle of it.
        stop = threading.Event()
        # Calls that began after the signal and succeeded.
        failures, begun_after = [], [0]
        t_signal = [float("inf")]
        lock = threading.Lock()

        def load():
            while not stop.is_set():
                try:
                    t_call = time.monotonic()
                    call(100)
                    with lock:
                        begun_after[0] += t_call > t_signal[0]
                except Exception as e:  # any failure fails the test
                    with lock:
                        since = time.monotonic() - t_signal[0]
                        failures.append("%s: %s" % (
                            "before the signal" if since < 0 else
                            "%.2f s after the signal" % since, e))

        threads = [threading.Thread(target=load) for _ in range(6)]
        for t in threads:
            t.start()
        assert wait_for(lambda: clients[0].metrics().get("coalesce_requests_running") >= 1, 10,
                        interval=0.005), "replica 0 never ran a stream"
        servers[0].proc.send_signal(signal.SIGTERM)
        t_signal[0] = time.monotonic()
        before = [ok_count(c) for c in clients[1:]]
        # Load goes on for 2 s of the drain, and until the six threads have
        # made six calls since the signal, however fast the replicas run.
        time.sleep(2.0)
        wait_for(lambda: begun_after[0] >= 6 or failures, 60)
        stop.set()
        for t in threads:
            t.join(60)

        assert failures == [], failures[:3]
        rc = servers[0].proc.wait(30)
        assert rc == 0
        assert time.monotonic() - t_signal[0] < 25
        log = servers[0].log()
        assert "draining" in log and "stopped" in log
        # After the signal, the other two took the new calls.
        after = [ok_count(c) for c in clients[1:]]
        assert all(a > b for a, b in zip(after, before)), (before, after)
        assert begun_after[0] >= 6, begun_after
    finally:
        if channel is not None:
            channel.close()
        for c in clients:
            c.close()
        for s in servers:
            s.kill()
