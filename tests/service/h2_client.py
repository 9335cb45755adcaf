"""A gRPC client written on raw HTTP/2 frames (python3-h2), to be the client
that gRPC's own library never is. Used by test_hostile_e2e.py and by
tools/soak/soak.py; needs nothing else from the tests."""

import socket
import threading

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings


class StalledClient:
    """A Generate call over raw HTTP/2 whose client announces a 16-byte
    receive window and never opens it again: the server can send it almost
    nothing. It answers pings, as a live but stuck process's kernel and
    HTTP/2 stack would until keepalive gave up."""

    def __init__(self, address, payload, headers=()):
        """`headers`: more (name, value) request headers, e.g. authorization."""
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)))
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 16})
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"),
                                     (":path", "/coalesce.v1.Generator/Generate"),
                                     (":authority", address), ("content-type", "application/grpc"),
                                     ("te", "trailers")] + list(headers))
        self.conn.send_data(sid, b"\x00" + len(payload).to_bytes(4, "big") + payload,
                            end_stream=True)
        self.sock.sendall(self.conn.data_to_send())
        self.reset = threading.Event()
        self.closed = False
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        while not self.closed:
            try:
                data = self.sock.recv(65536)
            except OSError:
                return
            if not data:
                return
            try:
                for event in self.conn.receive_data(data):
                    if isinstance(event, (h2.events.StreamReset, h2.events.StreamEnded,
                                          h2.events.ConnectionTerminated)):
                        self.reset.set()
                # Settings and ping acknowledgements, never a WINDOW_UPDATE.
                self.sock.sendall(self.conn.data_to_send())
            except (h2.exceptions.ProtocolError, OSError):
                return  # the connection is over

    def close(self):
        self.closed = True
        self.sock.close()
