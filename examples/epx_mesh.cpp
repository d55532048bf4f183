// epx-mesh: prints the rank table (or JSON) of a mesh.
//
//   epx-mesh --tp 2 --fsdp 4 --experts 8 --ep 2,4,8
//   epx-mesh --tp 2 --fsdp 4 --pp 2 --dp-replicate 2 --experts 16 --ep 4 --json
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

#include "epx/epx.hpp"

namespace {

void usage(std::ostream& os) {
  os << "usage: epx-mesh [--tp N] [--fsdp N] [--pp N] [--dp-replicate N] [--experts E]\n"
        "                [--ep N[,N...]] [--world W] [--json]\n"
        "Prints the rank table of the mesh for each --ep value (default: tp), or with --json\n"
        "the ranks, coordinates, experts and group members for one --ep value.\n";
}

// Decimal digits with an optional leading '-' (a negative size reaches the mesh's own check
// and its message), nothing else: strtol alone would also take leading blanks and a '+'.
int parse_int(const std::string& flag, const std::string& v) {
  const std::size_t first = !v.empty() && v[0] == '-' ? 1 : 0;
  const bool digits = v.size() > first && v.find_first_not_of("0123456789", first) == std::string::npos;
  char* end = nullptr;
  errno = 0;
  const long x = digits ? std::strtol(v.c_str(), &end, 10) : 0;
  if (!digits || *end != '\0' || errno != 0 || x < -(1L << 30) || x > (1L << 30))
    EPX_THROW(epx::errc::configuration, flag, " expects an integer, got '", v, "'");
  return static_cast<int>(x);
}

std::vector<int> parse_list(const std::string& flag, const std::string& v) {
  std::vector<int> out;
  std::size_t start = 0;
  while (start <= v.size()) {
    const std::size_t comma = v.find(',', start);
    const std::string item = v.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    out.push_back(parse_int(flag, item));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    epx::mesh_config c;
    std::vector<int> eps;
    bool json = false;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) EPX_THROW(epx::errc::configuration, a, " needs a value");
        return argv[++i];
      };
      if (a == "--tp") c.tp = parse_int(a, value());
      else if (a == "--fsdp") c.fsdp = parse_int(a, value());
      else if (a == "--pp") c.pp = parse_int(a, value());
      else if (a == "--dp-replicate") c.dp_replicate = parse_int(a, value());
      else if (a == "--experts") c.experts = parse_int(a, value());
      else if (a == "--world") c.world = parse_int(a, value());
      else if (a == "--ep") eps = parse_list(a, value());
      else if (a == "--json") json = true;
      else if (a == "-h" || a == "--help") { usage(std::cout); return 0; }
      else {
        usage(std::cerr);
        EPX_THROW(epx::errc::configuration, "unknown argument '", a, "'");
      }
    }
    if (eps.empty()) eps.push_back(c.tp);
    if (json) {
      if (eps.size() != 1) EPX_THROW(epx::errc::configuration, "--json takes exactly one --ep value, got ", eps.size());
      c.ep = eps.front();
      std::cout << epx::to_json(epx::mesh(c)) << "\n";
    } else {
      std::cout << epx::describe(c, eps);
    }
    return 0;
  } catch (const epx::error& e) {  // the command line: flags, or a mesh they describe
    std::cerr << "epx-mesh: " << e.message() << "\n";
    return 2;
  } catch (const std::exception& e) {  // a failure while printing (memory)
    std::cerr << "epx-mesh: " << e.what() << "\n";
    return 1;
  }
}
