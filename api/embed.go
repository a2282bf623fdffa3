package api

import _ "embed"

// OpenAPI is the OpenAPI 3.0 document of the REST API as implemented
// (openapi.yaml in this package). The apiserver serves it verbatim at
// GET /v1/openapi.yaml; openapi_test.go keeps it in step with the types.
//
//go:embed openapi.yaml
var OpenAPI []byte
