package agent

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"sync"
)

// Client calls an agent over a connection to its port.
type Client struct {
	mu  sync.Mutex
	c   io.ReadWriteCloser
	r   *bufio.Reader
	enc *json.Encoder
}

// NewClient wraps conn.
func NewClient(conn io.ReadWriteCloser) *Client {
	return &Client{c: conn, r: bufio.NewReaderSize(conn, 64<<10), enc: json.NewEncoder(conn)}
}

func (c *Client) read() (Response, error) {
	line, err := c.r.ReadBytes('\n')
	if err != nil {
		return Response{}, fmt.Errorf("reading from the agent: %w", err)
	}
	var resp Response
	if err := json.Unmarshal(line, &resp); err != nil {
		return Response{}, fmt.Errorf("decoding the agent's answer: %w", err)
	}
	return resp, nil
}

// WaitReady waits for the agent's first line, which says it serves.
func (c *Client) WaitReady(ctx context.Context) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	done := make(chan error, 1)
	go func() {
		resp, err := c.read()
		if err == nil && !resp.Ready {
			err = errors.New("the agent's first answer is not ready")
		}
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
		c.c.Close()
		<-done
		return ctx.Err()
	}
}

// Call sends req and returns the agent's answer. Calls are serialised;
// ctx ending closes the connection (the agent cannot be interrupted
// mid-request otherwise).
func (c *Client) Call(ctx context.Context, req Request) (Response, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	stop := context.AfterFunc(ctx, func() { c.c.Close() })
	defer stop()
	if err := c.enc.Encode(req); err != nil {
		return Response{}, fmt.Errorf("writing to the agent: %w", err)
	}
	resp, err := c.read()
	if err != nil && ctx.Err() != nil {
		return Response{}, ctx.Err()
	}
	return resp, err
}

// Close closes the connection.
func (c *Client) Close() error { return c.c.Close() }
