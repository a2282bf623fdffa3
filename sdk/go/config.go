package dsec

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
)

// Environment variables read by FromEnv.
const (
	EnvEndpoint = "DSEC_ENDPOINT"
	EnvAPIKey   = "DSEC_API_KEY"
	EnvConfig   = "DSEC_CONFIG" // path of the config file
)

// Config is the client config file, ~/.config/dsec/config.json, which
// `dsec up` writes and the CLI and SDKs read.
type Config struct {
	Endpoint string `json:"endpoint,omitempty"`
	APIKey   string `json:"api_key,omitempty"`
}

// DefaultConfigPath returns $DSEC_CONFIG, or ~/.config/dsec/config.json. The
// path is spelled out rather than taken from os.UserConfigDir so that every
// SDK (Go, Python) and `dsec up` agree on it regardless of XDG settings.
func DefaultConfigPath() (string, error) {
	if p := os.Getenv(EnvConfig); p != "" {
		return p, nil
	}
	home, err := os.UserHomeDir()
	if err != nil {
		return "", fmt.Errorf("finding config file: %w", err)
	}
	return filepath.Join(home, ".config", "dsec", "config.json"), nil
}

// LoadConfig reads a config file. A missing file is an error that matches
// fs.ErrNotExist.
func LoadConfig(path string) (Config, error) {
	var cfg Config
	b, err := os.ReadFile(path)
	if err != nil {
		return cfg, fmt.Errorf("reading config: %w", err)
	}
	if err := json.Unmarshal(b, &cfg); err != nil {
		return cfg, fmt.Errorf("parsing config %s: %w", path, err)
	}
	return cfg, nil
}

// SaveConfig writes cfg to path atomically, with mode 0600 (it holds an API
// key) in a directory created with mode 0700.
func SaveConfig(path string, cfg Config) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("creating config dir: %w", err)
	}
	b, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		return fmt.Errorf("encoding config: %w", err)
	}
	b = append(b, '\n')
	f, err := os.CreateTemp(dir, ".config-*.json")
	if err != nil {
		return fmt.Errorf("writing config: %w", err)
	}
	tmp := f.Name()
	defer os.Remove(tmp) // no-op after a successful rename
	// CreateTemp already uses 0600; Chmod makes it independent of that detail.
	if err := f.Chmod(0o600); err != nil {
		f.Close()
		return fmt.Errorf("writing config: %w", err)
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return fmt.Errorf("writing config: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("writing config: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("writing config: %w", err)
	}
	return nil
}

// ResolveConfig returns the effective endpoint and key: DSEC_ENDPOINT and
// DSEC_API_KEY win over the config file ($DSEC_CONFIG or
// ~/.config/dsec/config.json), which wins over DefaultEndpoint. A missing
// default config file is not an error; a missing file named by DSEC_CONFIG
// is.
func ResolveConfig() (Config, error) {
	var cfg Config
	path, err := DefaultConfigPath()
	if err == nil {
		cfg, err = LoadConfig(path)
		if errors.Is(err, fs.ErrNotExist) && os.Getenv(EnvConfig) == "" {
			err = nil
		}
	} else if os.Getenv(EnvEndpoint) != "" {
		err = nil // no home directory, but the environment says everything
	}
	if err != nil {
		return Config{}, err
	}
	if v := os.Getenv(EnvEndpoint); v != "" {
		cfg.Endpoint = v
	}
	if v := os.Getenv(EnvAPIKey); v != "" {
		cfg.APIKey = v
	}
	if cfg.Endpoint == "" {
		cfg.Endpoint = DefaultEndpoint
	}
	return cfg, nil
}

// FromEnv builds a Client from the environment and config file (see
// ResolveConfig). Options given here override both.
func FromEnv(opts ...Option) (*Client, error) {
	cfg, err := ResolveConfig()
	if err != nil {
		return nil, err
	}
	base := []Option{WithEndpoint(cfg.Endpoint), WithAPIKey(cfg.APIKey)}
	return New(append(base, opts...)...)
}
