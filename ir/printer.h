// Printer: the textual form of a module (the format Parse reads back; see printer.cc for the grammar).
#pragma once

#include <string>

#include "ir/module.h"

namespace shardstep::ir {

// Prints `m` in the textual IR form. Total: prints any module, valid or not, so it can dump IR
// after a failing pass. For valid modules Parse(Print(m)) == m.
std::string Print(const Module& m);

// Pieces of the format, shared with the parser's tests and error messages.
std::string PrintAttrValue(const AttrValue& v);
std::string PrintDouble(double d);               // shortest round-trip text, always float-looking
std::string QuoteString(const std::string& s);   // "..." with \" \\ \n \t \xHH escapes
std::string PrintName(const std::string& name);  // @name, or @"..." when not a bare name

}  // namespace shardstep::ir
