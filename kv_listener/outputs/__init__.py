"""Where prefix events leave the listener: the SSE app and the HTTP/2 event-bus pusher."""
